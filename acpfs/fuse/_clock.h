/* acpfs/fuse: the one clock of the extension's parts (_attrs.c, _atonce.c, _burst.c,
 * _fastwrite.c): CLOCK_MONOTONIC in nanoseconds, what Python's time.monotonic() reads. */
#ifndef ACPFS_CLOCK_H
#define ACPFS_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t monotonic_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

#endif
