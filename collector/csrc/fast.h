/* The Monitor's per-step host path in C (`meshscope.collector._fast`): what its parts share.

Why C: a host step only takes clock reads and hands references over; the Monitor's service
thread turns them into records (`collector/drain.py`). In Python, the frames of the step's
context, its phases, `log` and the model's forward watch cost the training thread ~110 us a
step on a 2-core host (each line 0.5-3 us cold after a step's compute); here they are a few C
calls. What the entry points tell each other (the step state, `collector/stepstate.py`) lives
in the `Steps` struct, and what they touch of the flight log, the expert counts and the watch
is kept from `attach`: after a step's compute an attribute lookup costs ~1 us of cold memory,
a struct field one cache line.

What it does is what the Python path (`Monitor._begin`, `Monitor._end`, `BackwardWatch`,
`ExpertCounts.forward_done`, `FlightLog.append_fixed`) does on such a step, timed
(`monitor.detail_every`) or not; anything else (the run's first step, which describes it, an
unusual counts tensor, a device) is handed to that Python code. `tests/collector/test_fast.py`
holds the two paths to the same records. Without a C compiler the package installs without
this module and every step takes the Python path.

The parts: module.c (configuration, the meter, the module), phases.c (a step's phase
contexts), steps.c (the step's context), handover.c (what a step's end hands over), flight.c
(the flight log's fixed records), lock.c (the flight log's lock), forward.c (the watch on the model's forward), backward.c (a
timed step's backward marks).
*/
#ifndef MESHSCOPE_FAST_H
#define MESHSCOPE_FAST_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

/* the same double Python's time.perf_counter / time.time give (3.11: clock_gettime, ns / 1e9) */
static inline double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9;
}

/* set by `configure` (module.c) */
extern PyObject *tensor_type, *is_grad_enabled, *queue_callback, *work_attribute;
extern Py_ssize_t header_size, record_size, head_size, written_offset; /* the flight log's layout */

/* `meter(True)`: thread CPU time of the C bodies no Python entry point wraps, for the overhead
   account (`benchmarks/overhead.py` meters the Python entry points around C itself) */
extern int metering;
extern double metered_seconds, marks_seconds, probe_seconds;
extern long long metered_calls, marks_calls, probe_calls;
#define METER_START() (metering ? clock_seconds(CLOCK_THREAD_CPUTIME_ID) : 0.0)
/* the meter around nothing, right after a metered body: what C's meter adds to each call */
#define METER_PROBE "C meter (empty)"
#define METER_ADD(seconds, calls, started)                                     \
    if (metering) {                                                            \
        seconds += clock_seconds(CLOCK_THREAD_CPUTIME_ID) - (started);         \
        calls++;                                                               \
    }

/* attribute and method names, interned once (module.c) */
extern PyObject *s_requires_grad, *s_data, *s_begin, *s_polled, *s_settle_polled, *s_written, *s_step, *s_in_flight, *s_layers, *s_every, *s_map, *s_counts, *s_version, *s_seen, *s_noted, *s_record, *s_sync, *s_packed, *s_log, *s_seq, *s_lock, *s_acquire, *s_release, *s_capacity, *s_host_groups, *s_host_slots, *s_idle_work, *s_opens, *s_forward_ended, *s_off_thread, *s_work, *s_handed, *s_append, *s_meter, *s_window, *s_wait, *s_grad_fn, *s_register_prehook, *s_take;

/* --- the steps of one Monitor ------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    PyObject *mon;            /* the Monitor: its `_begin` / `_end` take the steps C does not */
    PyObject *pending_append; /* the Monitor's pending steps' `append` */
    PyObject *flight;         /* FlightLog or None */
    PyObject *ends_append;    /* the flight log's queued step ends' `append`, or None */
    PyObject *watch;          /* BackwardWatch or None */
    PyObject *meter;          /* CommMeter */
    PyObject *experts;        /* ExpertCounts */
    PyObject *slow;           /* (scope, wall, start) of a step the Python path took, or NULL */
    PyObject *scalars;        /* what the step in C logged, or NULL */
    PyObject *next_step;      /* the `step` given to the next step, or NULL */
    PyObject *phases;         /* a timed step's {name: (start, end)}, or NULL (untimed) */
    PyObject *polled;         /* the flight log's works to settle (`FlightLog._polled`), or None */
    PyObject *map;            /* the flight log's map, whose header holds the step, or None */
    /* the step state the entry points share (`collector.stepstate`), here a field each: read
       after a step's compute, an attribute costs a dictionary lookup of cold memory */
    PyObject *memory;         /* the latest memory reading (a dict) */
    PyObject *opened;         /* flight records the step's untimed forwards opened (a list) */
    /* what the forward's watch reads, kept from `attach`: the expert counts' lists (each one
       list for the attachment's life: `ExpertCounts._take_noted`), and DDP's reduction record */
    PyObject *layers, *seen, *noted, *idle, *record;
    int timing, reduced, dirty;
    long long step, tokens, next_tokens, detail_every, memory_every, comm_every;
    long long expert_layers, expert_every; /* the watched model's MoE layers, steps per window */
    Py_ssize_t step_offset;   /* where the flight log's header keeps the current step */
    /* where it keeps the time and the step of the latest end (the watchdog's progress); -1:
       the drain writes them */
    Py_ssize_t progress_offset, reached_offset;
    double wall, start;
    int fast_ok;              /* the Monitor allows host steps in C (set by it) */
    int host_marks;           /* the Monitor's marks are perf_counter's: timed steps in C */
    int host_memory;          /* the Monitor reads host RSS only: a memory read in C */
    int fast_now;             /* a step in C is open (timed where `phases` is set) */
    int memory_due;           /* the open step in C reads memory as it ends (`memory_every`) */
    int expert_sum_due;       /* an expert window's sum may be in flight: see at this step's end */
    int in_step;
} Steps;

typedef struct {
    PyObject_HEAD
    PyObject *forward;  /* the model's own forward */
    PyObject *hook;     /* hook(model, args, output), as a forward hook is called */
    PyObject *model;
    PyObject *fast;     /* None, or (steps, watch, experts): the Monitor's watch in C */
    PyObject *dict;     /* __name__, __doc__, __wrapped__, as functools.wraps leaves them */
    /* DDP's reduction record, from its first packing on (`FixedRecord._packed`): its name and
       tail, and its flight log's sequence numbers, lock and queue of opens for the drain */
    PyObject *name, *tail, *seqs, *lock, *opens_append;
    /* a timed host step's backward marks (`BackwardWatch`'s callbacks, bound to this object) */
    PyObject *on_start, *on_local, *on_graph_done, *on_reduced;
} Forward;

extern PyTypeObject NoOpType, PhaseType, StepsType, ForwardType, LockType;
extern PyObject *the_noop;               /* an untimed step's phase (phases.c) */
extern PyMethodDef callback_defs[4];     /* a timed step's backward callbacks (backward.c) */

int truthy_attr(PyObject *obj, PyObject *name);                               /* module.c */
long long rss_bytes(void);                                                    /* module.c */
PyObject *take_open(Steps *self);                                             /* handover.c */
int set_flight_progress(Steps *self, long long step, double at);
int flight_end(Steps *self, double end, PyObject *opened);
int experts_end(Steps *self);
int lock_take(PyObject *lock);                                                /* lock.c */
int lock_give(PyObject *lock);
int take_seq(PyObject *seqs, PyObject *name, long long *seq);                 /* flight.c */
int release(PyObject *lock);
PyObject *append_fixed_c(PyObject *log, PyObject *name, PyObject *tail, PyObject *step);
PyObject *append_fixed(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
int open_reduction(Forward *self, PyObject *record);                         /* forward.c */
int backward_syncs(Forward *self);
int timed_forward(Forward *self, PyObject *output);                           /* backward.c */

#endif
