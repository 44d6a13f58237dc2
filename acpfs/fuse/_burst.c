/*
 * acpfs.fuse._fastwrite, part four: a burst of requests answered without returning to trio.
 *
 * pyfuse3 reads one request per trip through its loop: a trio task waits for the device to
 * become readable (an epoll registration, a trio lock handed between its worker tasks, a
 * pass of the scheduler), reads the request and hands it to libfuse's dispatch
 * (fuse_session_process_buf), which calls a handler. Where the handler answered at once
 * (the attribute table, _attrs.c; the hooks of _atonce.c; a WRITE, _fastwrite.c) the reply
 * is sent before the dispatch returns, and the trip through trio was all the request cost
 * besides: more than the handler (docs/benchmarks.md, "A burst answered without trio").
 *
 * So fuse_session_process_buf is interposed (as fuse_session_new is): after the request
 * pyfuse3 read, as long as each request was answered during its dispatch, the next one is
 * read here and dispatched too, until the device has none, one goes to a pyfuse3 handler
 * (it left no reply: its coroutine, which pyfuse3 awaits once the dispatch returns, will
 * answer), or the burst reaches MAX_BURST requests or MAX_BURST_NS (other trio tasks wait
 * meanwhile). A request another task of pyfuse3 would have read is read here instead; the
 * order the kernel queued them in is kept.
 *
 * Where the device has no request yet, the next one of a burst (a program working on small
 * files sends them back to back, a few microseconds apart) is waited for by polling the
 * device for up to ``poll_ns`` with the GIL released: a wakeup of the daemon's thread costs
 * more on a virtual machine than that wait (an interrupt to a halted vCPU and a VM exit).
 *
 *     burst_config(max_requests, poll_ns)    max_requests 1: the loop is off
 *     burst_stats() -> dict
 *     burst_last_request() -> float           time.monotonic() of the last request that
 *                                            is not data (READ, WRITE) or a FORGET
 *
 * Every request of the session is dispatched through here, those C answers too, so this is
 * where the flusher learns that programs are at work (flusher/giveway.py).
 *
 * A reply is told from other writes to the device (the notifications another thread sends)
 * by its unique id (burst_note_reply, from the session's writev).
 *
 * Threads: the trio thread, with the GIL held but while polling.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 32
#include <fuse_lowlevel.h>
#include <linux/fuse.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <time.h>

#include "_burst.h"
#include "_clock.h"
#include "_idlepoll.h"

#define MAX_BURST_NS 2000000LL   /* 2 ms: trio's other tasks wait no longer */

typedef void (*process_buf_fn)(struct fuse_session *, const struct fuse_buf *);

static long max_burst = 64;        /* requests per burst, the first one included */
static long long poll_ns = 50000;  /* how long to poll for the next one */
static uint64_t current_unique;    /* the request being dispatched here */
static int current_answered;       /* ... was answered during its dispatch */
static struct fuse_buf next_buf;   /* the requests read here (libfuse allocates it) */
static unsigned long long bursts, extra, caught, polled_ns;
static uint64_t last_request_ns;  /* CLOCK_MONOTONIC; read by the flusher's threads (GIL) */

void burst_note_reply(uint64_t unique)
{
    if (unique != 0 && unique == current_unique)
        current_answered = 1;
}

void burst_reset(void)
{
    current_unique = 0;
    current_answered = 0;
}

static uint64_t unique_of(const struct fuse_buf *buf)
{
    if ((buf->flags & FUSE_BUF_IS_FD) || buf->size < sizeof(struct fuse_in_header))
        return 0;   /* in a pipe (splice): not looked at; the burst ends after it */
    return ((const struct fuse_in_header *)buf->mem)->unique;
}

/* A request arrives: stamped unless it moves data or only drops references. */
static void note_request(const struct fuse_buf *buf)
{
    if ((buf->flags & FUSE_BUF_IS_FD) || buf->size < sizeof(struct fuse_in_header))
        return;
    switch (((const struct fuse_in_header *)buf->mem)->opcode) {
    case FUSE_READ: case FUSE_WRITE: case FUSE_FORGET: case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        return;
    default:
        last_request_ns = monotonic_ns();
    }
}

/* Dispatches one request; whether it was answered during the dispatch. */
static int dispatched(process_buf_fn real, struct fuse_session *se, const struct fuse_buf *buf)
{
    note_request(buf);
    current_unique = unique_of(buf);
    current_answered = 0;
    real(se, buf);
    int answered = current_unique != 0 && current_answered;
    current_unique = 0;
    return answered;
}

/* Whether the device has a request: at once, or within poll_ns (GIL released). A signal
 * (poll's EINTR) ends the wait: trio handles it once the dispatch returns. */
static int readable(int fd, long long budget)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int n = poll(&p, 1, 0);
    if (n != 0 || budget <= 0)
        return n > 0;
    int ready = 0;
    uint64_t start, end;
    Py_BEGIN_ALLOW_THREADS
    start = end = monotonic_ns();
    while ((long long)(end - start) < budget) {
        p.revents = 0;
        n = poll(&p, 1, 0);
        if (n != 0) {
            ready = n > 0;
            break;
        }
        end = monotonic_ns();
    }
    Py_END_ALLOW_THREADS
    polled_ns += end - start;
    caught += ready;
    return ready;
}

/* The next request into next_buf, never waiting: a request seen by poll may be gone by the
 * read (the kernel withdraws a request not yet read when its caller is interrupted). The
 * device is non-blocking while the session's I/O is ours (_fastwrite.c); where it is not,
 * it is made so for this read alone. */
static int receive(struct fuse_session *se)
{
    if (fastwrite_nonblocking())
        return fuse_session_receive_buf(se, &next_buf);
    int fd = fuse_session_fd(se), flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return -errno;
    int res = fuse_session_receive_buf(se, &next_buf);
    fcntl(fd, F_SETFL, flags);
    return res;
}

void fuse_session_process_buf(struct fuse_session *se, const struct fuse_buf *buf)
{
    static process_buf_fn real;
    if (real == NULL
        && (real = (process_buf_fn)fastwrite_libfuse_symbol("fuse_session_process_buf")) == NULL)
        return;
    if (se != fastwrite_session()) {
        real(se, buf);
        return;
    }
    idlepoll_note_request();
    if (max_burst <= 1) {
        note_request(buf);
        real(se, buf);
        return;
    }
    if (!dispatched(real, se, buf))
        return;
    bursts++;
    uint64_t deadline = monotonic_ns() + MAX_BURST_NS;
    for (long n = 1; n < max_burst && monotonic_ns() < deadline; n++) {
        if (fuse_session_exited(se) || !readable(fuse_session_fd(se), poll_ns))
            return;
        int res = receive(se);
        if (res <= 0)
            return;   /* none after all, a signal, or what pyfuse3's next read sees too (an
                       * unmount: ENODEV) */
        extra++;
        idlepoll_note_request();
        if (!dispatched(real, se, &next_buf))
            return;   /* a coroutine of pyfuse3's holds it: pyfuse3 awaits it next */
    }
}

static PyObject *burst_config(PyObject *self, PyObject *args)
{
    long requests;
    long long ns;
    if (!PyArg_ParseTuple(args, "lL", &requests, &ns))
        return NULL;
    max_burst = requests < 1 ? 1 : requests;
    poll_ns = ns < 0 ? 0 : ns;
    Py_RETURN_NONE;
}

static PyObject *burst_stats(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{s:l,s:L,s:K,s:K,s:K,s:K}", "max_requests", max_burst, "poll_ns",
                         poll_ns, "bursts", bursts, "extra", extra, "caught", caught,
                         "polled_ns", polled_ns);
}

static PyObject *burst_last_request(PyObject *self, PyObject *unused)
{
    return PyFloat_FromDouble((double)last_request_ns / 1e9);
}

PyMethodDef burst_methods[] = {
    {"burst_last_request", burst_last_request, METH_NOARGS,
     "time.monotonic() when the last request that is not a READ, WRITE or FORGET arrived "
     "(0.0: none yet)."},
    {"burst_config", burst_config, METH_VARARGS,
     "burst_config(max_requests, poll_ns): requests dispatched per trip through pyfuse3's "
     "loop (1: one, as pyfuse3 does), and how long to poll for the next one."},
    {"burst_stats", burst_stats, METH_NOARGS,
     "{'max_requests', 'poll_ns', 'bursts': dispatches that went on past pyfuse3's request, "
     "'extra': requests read here, 'caught': of them, found by polling, 'polled_ns'}"},
    {NULL, NULL, 0, NULL},
};
