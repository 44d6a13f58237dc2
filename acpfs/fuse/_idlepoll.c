/*
 * acpfs.fuse._fastwrite, part five: idle CPUs poll while requests arrive (--idle-poll).
 *
 * A program blocked on a FUSE request sleeps until the daemon's reply wakes it. Where its
 * CPU went idle meanwhile, that wakeup is an interrupt to a halted CPU: on a virtual
 * machine a VM exit and a re-entry, tens of microseconds, for every request (the daemon's
 * own thread polls the device between requests: _burst.c). The kernel's idle loop can poll
 * instead of halting (the cpuidle POLL state, where a remote wakeup needs no interrupt)
 * whenever a CPU latency request of 0 us is held through /dev/cpu_dma_latency (the PM QoS
 * interface of kernel/power/qos.c; the haltpoll and menu governors honour it).
 *
 * So while requests arrive the daemon holds such a request, and lets it go once none came
 * for ``tail_ns``: the first request after a quiet spell writes 0 to the device (on the
 * thread that dispatches it), and a thread of this part writes -1 (PM_QOS_DEFAULT_VALUE:
 * no constraint) once the mount has been quiet that long. Idle CPUs spin only while
 * programs are at work on the mount, and for ``tail_ns`` after.
 *
 *     idle_poll_start(path, tail_ns)   open the device (OSError where it cannot: not root)
 *                                      and start the releasing thread
 *     idle_poll_stop()                 let go, stop the thread, close the device
 *     idle_poll_stats() -> dict        {'on', 'held', 'holds', 'held_s', 'tail_ns',
 *                                       'errors'}
 *     idlepoll_note_request()          (C, _burst.c) a request of the session arrived
 *
 * Threads and locks: ``mu`` guards ``held``, the writes to the device and the counts;
 * ``last_ns`` is written by the dispatching thread (the trio thread) without it, and read
 * by the releasing thread. The releasing thread never touches Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "_clock.h"
#include "_idlepoll.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv;              /* signalled when a hold begins, or at stop */
static pthread_t releaser;
static int fd = -1;                    /* the device; -1: off */
static int held, stopping;             /* (mu) */
static uint64_t tail_ns = 50000000ULL;
static uint64_t last_ns;               /* the last request (atomic) */
static uint64_t held_since, held_ns;   /* (mu) */
static unsigned long long holds, errors;   /* (mu) */

/* Writes a latency request of ``us`` (-1: none) to the device (hold mu). */
static void request_latency(int32_t us)
{
    if (write(fd, &us, sizeof us) != (ssize_t)sizeof us)
        errors++;
}

void idlepoll_note_request(void)
{
    if (__atomic_load_n(&fd, __ATOMIC_ACQUIRE) < 0)
        return;
    uint64_t now = monotonic_ns();
    __atomic_store_n(&last_ns, now, __ATOMIC_RELEASE);
    if (__atomic_load_n(&held, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&mu);
    if (!held && fd >= 0 && !stopping) {
        request_latency(0);
        __atomic_store_n(&held, 1, __ATOMIC_RELEASE);
        held_since = now;
        holds++;
        pthread_cond_signal(&cv);
    }
    pthread_mutex_unlock(&mu);
}

/* Lets go (hold mu). */
static void let_go(uint64_t now)
{
    if (!held)
        return;
    request_latency(-1);
    __atomic_store_n(&held, 0, __ATOMIC_RELEASE);
    held_ns += now - held_since;
}

static void *release_when_quiet(void *unused)
{
    pthread_mutex_lock(&mu);
    while (!stopping) {
        if (!held) {
            pthread_cond_wait(&cv, &mu);
            continue;
        }
        uint64_t last = __atomic_load_n(&last_ns, __ATOMIC_ACQUIRE), now = monotonic_ns();
        if (now >= last + tail_ns) {
            let_go(now);
            continue;
        }
        uint64_t until = last + tail_ns;
        struct timespec ts = {.tv_sec = (time_t)(until / 1000000000ULL),
                              .tv_nsec = (long)(until % 1000000000ULL)};
        pthread_cond_timedwait(&cv, &mu, &ts);
    }
    let_go(monotonic_ns());
    pthread_mutex_unlock(&mu);
    return NULL;
}

static PyObject *idle_poll_start(PyObject *self, PyObject *args)
{
    const char *path;
    unsigned long long tail;
    if (!PyArg_ParseTuple(args, "sK", &path, &tail))
        return NULL;
    if (fd >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "idle polling is already on");
        return NULL;
    }
    int f = open(path, O_WRONLY | O_CLOEXEC);
    if (f < 0)
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&cv, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_lock(&mu);
    tail_ns = tail;
    held = stopping = 0;
    int err = pthread_create(&releaser, NULL, release_when_quiet, NULL);
    if (err == 0)
        __atomic_store_n(&fd, f, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&mu);
    if (err != 0) {
        close(f);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *idle_poll_stop(PyObject *self, PyObject *unused)
{
    if (__atomic_load_n(&fd, __ATOMIC_ACQUIRE) < 0)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    stopping = 1;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(releaser, NULL);
    pthread_mutex_lock(&mu);
    close(fd);
    __atomic_store_n(&fd, -1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *idle_poll_stats(PyObject *self, PyObject *unused)
{
    pthread_mutex_lock(&mu);
    uint64_t now = monotonic_ns();
    int on = fd >= 0, is_held = held;
    double held_s = (double)(held_ns + (held ? now - held_since : 0)) / 1e9;
    unsigned long long h = holds, e = errors, t = tail_ns;
    pthread_mutex_unlock(&mu);
    return Py_BuildValue("{s:O,s:O,s:K,s:d,s:K,s:K}", "on", on ? Py_True : Py_False, "held",
                         is_held ? Py_True : Py_False, "holds", h, "held_s", held_s,
                         "tail_ns", t, "errors", e);
}

PyMethodDef idlepoll_methods[] = {
    {"idle_poll_start", idle_poll_start, METH_VARARGS,
     "idle_poll_start(path, tail_ns): hold a CPU latency request of 0 us on the device at "
     "path while requests arrive, let go after tail_ns without one (OSError where the "
     "device cannot be opened)."},
    {"idle_poll_stop", idle_poll_stop, METH_NOARGS,
     "Let go of the latency request, stop its thread and close the device."},
    {"idle_poll_stats", idle_poll_stats, METH_NOARGS,
     "{'on', 'held', 'holds': requests held since start, 'held_s': seconds held, "
     "'tail_ns', 'errors': writes to the device that failed}"},
    {NULL, NULL, 0, NULL},
};
