/* meshscope.collector._fast: the Monitor's untimed host steps in C.

Why C: a step the Monitor does not time in full (`monitor.detail_every`, 9 in 10 on the host)
only takes two clock reads and hands references over; the Monitor's service thread turns them
into records (`collector.monitor.StepDrain`). In Python, the frames of the step's context, its
phases, `log` and the model's forward watch cost the training thread ~80 us a step on a 2-core
host (each line 0.5-3 us cold after a step's compute); here they are a few C calls.

What it does is exactly what the Python path (`Monitor._begin`, `Monitor._end`,
`BackwardWatch._on_forward`, `ExpertCounts.forward_done`, `FlightLog.append_fixed`) does on
such a step; anything else (a timed step, a memory read, a window that closes, an unusual
counts tensor) is handed to that Python code. `tests/collector/test_fast.py` holds the two
paths to the same records. Without a C compiler the package installs without this module and
every step takes the Python path.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

/* the same double Python's time.perf_counter / time.time give (3.11: clock_gettime, ns / 1e9) */
static double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9;
}

static PyObject *tensor_type;  /* torch.Tensor, set by `configure` */

/* `meter(True)`: thread CPU time of the forward watch's C body, for the overhead account
   (`benchmarks/overhead.py` meters the Python entry points around C itself) */
static int metering;
static double metered_seconds, marks_seconds;
static long long metered_calls, marks_calls;
#define METER_START() (metering ? clock_seconds(CLOCK_THREAD_CPUTIME_ID) : 0.0)
#define METER_ADD(seconds, calls, started)                                     \
    if (metering) {                                                            \
        seconds += clock_seconds(CLOCK_THREAD_CPUTIME_ID) - (started);         \
        calls++;                                                               \
    }
static PyObject *is_grad_enabled;  /* torch.is_grad_enabled */
static PyObject *s_requires_grad, *s_detach, *s_begin, *s_end, *s_step_ended, *s_take, *s_dirty,
    *s_reduced, *s_open, *s_memory, *s_polled, *s_settle_polled, *s_written, *s_step, *s_timing,
    *s_in_flight, *s_layers, *s_every, *s_map, *s_counts, *s_version, *s_is_inference, *s_seen,
    *s_noted, *s_work_attr, *s_forward_done, *s_record, *s_sync, *s_packed, *s_log, *s_seq, *s_lock,
    *s_acquire, *s_release, *s_capacity, *s_host_groups, *s_host_slots, *s_after_forward, *s_idle_work,
    *s_opens, *s_forward_ended, *s_off_thread, *s_work, *s_handed, *s_append, *s_meter, *s_window, *s_wait,
    *s_grad_fn, *s_register_prehook;

/* --- a phase of an untimed step: a context that does nothing ------------------------------ */
typedef struct {
    PyObject_HEAD
} NoOp;

static PyObject *noop_enter(PyObject *self, PyObject *unused) { Py_RETURN_NONE; }
static PyObject *noop_exit(PyObject *self, PyObject *const *args, Py_ssize_t n) { Py_RETURN_NONE; }

static PyMethodDef noop_methods[] = {
    {"__enter__", (PyCFunction)noop_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))noop_exit, METH_FASTCALL, NULL},
    {NULL}};

static PyTypeObject NoOpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshscope.collector._fast.NoOp",
    .tp_basicsize = sizeof(NoOp),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The phase of an untimed step: a context that does nothing.",
    .tp_methods = noop_methods,
    .tp_new = PyType_GenericNew,
};

static PyObject *the_noop;

/* --- a phase of a timed host step: its two marks into the step's phases ------------------- */
typedef struct {
    PyObject_HEAD
    PyObject *phases; /* the step's {name: (start, end)} */
    PyObject *name;
    double start;
} Phase;

static int phase_traverse(Phase *self, visitproc visit, void *arg) {
    Py_VISIT(self->phases);
    Py_VISIT(self->name);
    return 0;
}

static int phase_clear(Phase *self) {
    Py_CLEAR(self->phases);
    Py_CLEAR(self->name);
    return 0;
}

static void phase_dealloc(Phase *self) {
    PyObject_GC_UnTrack(self);
    phase_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int phase_init(Phase *self, PyObject *args, PyObject *kwds) {
    PyObject *phases, *name;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &phases, &name)) return -1;
    Py_XSETREF(self->phases, Py_NewRef(phases));
    Py_XSETREF(self->name, Py_NewRef(name));
    return 0;
}

static PyObject *phase_enter(Phase *self, PyObject *unused) {
    self->start = clock_seconds(CLOCK_MONOTONIC);
    Py_RETURN_NONE;
}

static PyObject *phase_exit(Phase *self, PyObject *const *args, Py_ssize_t n) {
    PyObject *span = Py_BuildValue("(dd)", self->start, clock_seconds(CLOCK_MONOTONIC));
    if (span == NULL || PyDict_SetItem(self->phases, self->name, span) < 0) {
        Py_XDECREF(span);
        return NULL;
    }
    Py_DECREF(span);
    Py_RETURN_NONE;
}

static PyMethodDef phase_methods[] = {
    {"__enter__", (PyCFunction)phase_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))phase_exit, METH_FASTCALL, NULL},
    {NULL}};

static PyTypeObject PhaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshscope.collector._fast.Phase",
    .tp_basicsize = sizeof(Phase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Phase(phases, name): a timed host step's phase, its perf_counter marks into phases[name].",
    .tp_traverse = (traverseproc)phase_traverse,
    .tp_clear = (inquiry)phase_clear,
    .tp_dealloc = (destructor)phase_dealloc,
    .tp_init = (initproc)phase_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = phase_methods,
};

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
    PyObject *scalars;        /* what an untimed step logged, or NULL */
    PyObject *next_step;      /* the `step` given to the next step, or NULL */
    long long step, tokens, next_tokens, detail_every, memory_every;
    long long expert_layers, expert_every; /* the watched model's MoE layers, steps per window */
    Py_ssize_t step_offset;   /* where the flight log's header keeps the current step */
    double wall, start;
    int fast_ok;              /* the Monitor allows untimed steps in C (set by it) */
    int host_marks;           /* the Monitor's marks are perf_counter's: a timed step's backward marks in C */
    int fast_now;             /* an untimed step in C is open */
    int in_step;
} Steps;

static int steps_traverse(Steps *self, visitproc visit, void *arg) {
    Py_VISIT(self->mon);
    Py_VISIT(self->pending_append);
    Py_VISIT(self->flight);
    Py_VISIT(self->ends_append);
    Py_VISIT(self->watch);
    Py_VISIT(self->meter);
    Py_VISIT(self->experts);
    Py_VISIT(self->slow);
    Py_VISIT(self->scalars);
    Py_VISIT(self->next_step);
    return 0;
}

static int steps_clear(Steps *self) {
    Py_CLEAR(self->mon);
    Py_CLEAR(self->pending_append);
    Py_CLEAR(self->flight);
    Py_CLEAR(self->ends_append);
    Py_CLEAR(self->watch);
    Py_CLEAR(self->meter);
    Py_CLEAR(self->experts);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->scalars);
    Py_CLEAR(self->next_step);
    return 0;
}

static void steps_dealloc(Steps *self) {
    PyObject_GC_UnTrack(self);
    steps_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int steps_init(Steps *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"monitor", "pending", "detail_every", "memory_every", "step_offset", NULL};
    PyObject *mon, *pending;
    long long detail, memory;
    Py_ssize_t offset;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLLn", kwlist, &mon, &pending, &detail, &memory, &offset))
        return -1;
    if (detail < 1 || memory < 1) {
        PyErr_SetString(PyExc_ValueError, "detail_every and memory_every must be at least 1");
        return -1;
    }
    PyObject *append = PyObject_GetAttrString(pending, "append");
    if (append == NULL) return -1;
    steps_clear(self);
    self->mon = Py_NewRef(mon);
    self->pending_append = append;
    self->flight = Py_NewRef(Py_None);
    self->ends_append = Py_NewRef(Py_None);
    self->watch = Py_NewRef(Py_None);
    self->meter = Py_NewRef(Py_None);
    self->experts = Py_NewRef(Py_None);
    self->detail_every = detail;
    self->memory_every = memory;
    self->step_offset = offset;
    self->step = -1;
    return 0;
}

/* `attach(flight, watch, meter, experts, fast_ok, host_marks)`: what the Monitor watches now */
static PyObject *steps_attach(Steps *self, PyObject *args) {
    PyObject *flight, *watch, *meter, *experts;
    int ok, host_marks;
    if (!PyArg_ParseTuple(args, "OOOOpp", &flight, &watch, &meter, &experts, &ok, &host_marks)) return NULL;
    PyObject *ends_append = Py_NewRef(Py_None);
    if (flight != Py_None) {
        PyObject *ends = PyObject_GetAttrString(flight, "_ends");
        if (ends == NULL) return NULL;
        Py_DECREF(ends_append);
        ends_append = PyObject_GetAttrString(ends, "append");
        Py_DECREF(ends);
        if (ends_append == NULL) return NULL;
    }
    Py_XSETREF(self->ends_append, ends_append);
    Py_XSETREF(self->flight, Py_NewRef(flight));
    Py_XSETREF(self->watch, Py_NewRef(watch));
    Py_XSETREF(self->meter, Py_NewRef(meter));
    PyObject *layers = PyObject_GetAttr(experts, s_layers), *every = PyObject_GetAttr(experts, s_every);
    Py_ssize_t n = layers == NULL ? -1 : PyObject_Length(layers);
    long long e = every == NULL ? -1 : PyLong_AsLongLong(every);
    Py_XDECREF(layers);
    Py_XDECREF(every);
    if (n < 0 || e < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ExpertCounts.every must be at least 1");
        return NULL;
    }
    Py_XSETREF(self->experts, Py_NewRef(experts));
    self->expert_layers = n;
    self->expert_every = e;
    self->fast_ok = ok;
    self->host_marks = host_marks;
    Py_RETURN_NONE;
}

/* `mon.step(tokens=0, step=None)`: the context of the next step (this object) */
static PyObject *steps_call_step(Steps *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *tokens = nargs > 0 ? args[0] : NULL, *step = nargs > 1 ? args[1] : NULL;
    if (nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "step() takes at most 2 positional arguments (tokens, step)");
        return NULL;
    }
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(name, "tokens") == 0 && tokens == NULL)
            tokens = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(name, "step") == 0 && step == NULL)
            step = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "step() got an unexpected or repeated keyword %R", name);
            return NULL;
        }
    }
    long long n = 0;
    if (tokens != NULL) {  /* any number, as a whole count (a float from a user's sum too) */
        PyObject *whole = PyNumber_Long(tokens);
        n = whole == NULL ? -1 : PyLong_AsLongLong(whole);
        Py_XDECREF(whole);
        if (n == -1 && PyErr_Occurred()) return NULL;
    }
    self->next_tokens = n;
    Py_XSETREF(self->next_step, step == NULL || step == Py_None ? NULL : Py_NewRef(step));
    return Py_NewRef(self);
}

static int set_flight_step(Steps *self, long long step) {
    PyObject *value = PyLong_FromLongLong(step);
    if (value == NULL || PyObject_SetAttr(self->flight, s_step, value) < 0) {
        Py_XDECREF(value);
        return -1;
    }
    Py_DECREF(value);
    PyObject *map = PyObject_GetAttr(self->flight, s_map);
    if (map == NULL) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(map, &view, PyBUF_WRITABLE) < 0) {  /* a closed log: nothing to tell */
        Py_DECREF(map);
        PyErr_Clear();
        return 0;
    }
    if (view.len >= self->step_offset + 8) {
        int64_t s = step;
        memcpy((char *)view.buf + self->step_offset, &s, 8);  /* little-endian hosts only (x86, arm) */
    }
    PyBuffer_Release(&view);
    Py_DECREF(map);
    return 0;
}

static PyObject *steps_enter(Steps *self, PyObject *unused) {
    if (self->in_step) {
        PyErr_SetString(PyExc_RuntimeError, "meshscope: a step is already open (steps do not nest)");
        return NULL;
    }
    long long step;
    if (self->next_step != NULL) {
        step = PyLong_AsLongLong(self->next_step);
        if (step == -1 && PyErr_Occurred()) return NULL;
    } else
        step = self->step + 1;
    self->tokens = self->next_tokens;
    int fast = self->fast_ok && step % self->detail_every != 0 && step % self->memory_every != 0;
    if (!fast) {  /* the Python path: it sets the step through the Monitor's `_step` */
        PyObject *res = PyObject_CallMethod(
            self->mon, "_begin", "LO", self->tokens, self->next_step ? self->next_step : Py_None);
        if (res == NULL) return NULL;
        if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 3) {
            Py_DECREF(res);
            PyErr_SetString(PyExc_TypeError, "Monitor._begin must return (scope, wall, start)");
            return NULL;
        }
        Py_XSETREF(self->slow, res);
        self->in_step = 1;
        return Py_NewRef(PyTuple_GET_ITEM(res, 0));
    }
    self->step = step;
    self->wall = clock_seconds(CLOCK_REALTIME);
    self->start = clock_seconds(CLOCK_MONOTONIC);
    if (self->flight != Py_None && set_flight_step(self, step) < 0) return NULL;
    if (self->watch != Py_None && PyObject_SetAttr(self->watch, s_timing, Py_False) < 0) return NULL;
    Py_CLEAR(self->scalars);
    self->fast_now = self->in_step = 1;
    return Py_NewRef(self);
}

/* the slots of the records an untimed forward opened (`BackwardWatch.take_open`), or NULL */
static PyObject *take_open(Steps *self) {
    PyObject *opened = PyObject_GetAttr(self->watch, s_open);
    if (opened == NULL) return NULL;
    if (PyList_Check(opened) && PyList_GET_SIZE(opened) == 0) {
        Py_DECREF(opened);
        return Py_NewRef(Py_None);
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL || PyObject_SetAttr(self->watch, s_open, fresh) < 0) {
        Py_XDECREF(fresh);
        Py_DECREF(opened);
        return NULL;
    }
    Py_DECREF(fresh);
    return opened;
}

static int flight_end(Steps *self, double end, PyObject *opened) {
    PyObject *polled = PyObject_GetAttr(self->flight, s_polled);
    if (polled == NULL) return -1;
    int waiting = PyObject_IsTrue(polled);
    Py_DECREF(polled);
    if (waiting < 0) return -1;
    if (waiting) {
        PyObject *r = PyObject_CallMethodNoArgs(self->flight, s_settle_polled);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    PyObject *written = PyObject_GetAttr(self->flight, s_written);
    if (written == NULL) return -1;
    PyObject *slots = opened == Py_None ? PyTuple_New(0) : Py_NewRef(opened);
    if (slots == NULL) {
        Py_DECREF(written);
        return -1;
    }
    /* (step, took, at, reduced slots, written): what `FlightLog.step_end` queues */
    PyObject *entry = Py_BuildValue(
        "(LddNN)", self->step, end - self->start, clock_seconds(CLOCK_REALTIME), slots, written);
    if (entry == NULL) return -1;
    PyObject *r = PyObject_CallOneArg(self->ends_append, entry);
    Py_DECREF(entry);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* A window the service thread sums (`ExpertCounts._off_thread`, decided at the first window in
   Python): its noted counts handed over. 1 when done, 0 to leave it to Python (no decision
   yet, or this rank's experts' work to take), -1 on error. */
static int hand_over(Steps *self) {
    PyObject *off = PyObject_GetAttr(self->experts, s_off_thread), *work = NULL, *noted = NULL, *handed = NULL;
    PyObject *fresh = NULL, *entry = NULL, *r = NULL;
    int ok = -1;
    if (off == NULL) return -1;
    if (off != Py_True) {
        ok = 0;
        goto done;
    }
    if ((work = PyObject_GetAttr(self->experts, s_work)) == NULL) goto done;
    if (!PyList_Check(work)) {
        ok = 0;
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(work); i++)
        if (PyList_GET_ITEM(work, i) != Py_None) {  /* expert parallelism: Python takes it */
            ok = 0;
            goto done;
        }
    if ((noted = PyObject_GetAttr(self->experts, s_noted)) == NULL || (fresh = PyList_New(0)) == NULL ||
        PyObject_SetAttr(self->experts, s_noted, fresh) < 0)
        goto done;
    if ((handed = PyObject_GetAttr(self->experts, s_handed)) == NULL ||
        (entry = Py_BuildValue("(LO)", self->step, noted)) == NULL ||
        (r = PyObject_CallMethodOneArg(handed, s_append, entry)) == NULL)
        goto done;
    ok = 1;
done:
    Py_XDECREF(off);
    Py_XDECREF(work);
    Py_XDECREF(noted);
    Py_XDECREF(handed);
    Py_XDECREF(fresh);
    Py_XDECREF(entry);
    Py_XDECREF(r);
    return ok;
}

/* `ExpertCounts.step_ended(step)`: nothing on most steps; a closed window handed over to the
   service thread here (`_handed`) when nothing else is due; the rest in Python */
static int experts_end(Steps *self) {
    if (self->expert_layers == 0) return 0;
    PyObject *flying = PyObject_GetAttr(self->experts, s_in_flight);
    if (flying == NULL) return -1;
    int settle = flying != Py_None;
    Py_DECREF(flying);
    int closes = (self->step + 1) % self->expert_every == 0;
    if (!settle && !closes) return 0;
    if (!settle) {
        int handed = hand_over(self);
        if (handed != 0) return handed < 0 ? -1 : 0;
    }
    PyObject *r = PyObject_CallMethod(self->experts, "step_ended", "L", self->step);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int truthy_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static int fast_end(Steps *self) {
    double end = clock_seconds(CLOCK_MONOTONIC);
    PyObject *comm = NULL, *opened = NULL, *memory = NULL, *item = NULL;
    int reduced = 0, ok = -1;
    int dirty = truthy_attr(self->meter, s_dirty);  /* a hook counted: the window is this step's */
    if (dirty < 0) goto done;
    comm = dirty ? PyObject_CallMethod(self->meter, "take", "O", Py_False) : Py_NewRef(Py_None);
    if (comm == NULL) goto done;
    if (self->watch != Py_None) {
        reduced = truthy_attr(self->watch, s_reduced);
        if (reduced < 0 || (reduced && PyObject_SetAttr(self->watch, s_reduced, Py_False) < 0)) goto done;
        opened = take_open(self);
    } else
        opened = Py_NewRef(Py_None);
    if (opened == NULL) goto done;
    memory = PyObject_GetAttr(self->mon, s_memory);  /* not due (`memory_every`): the latest reading */
    if (memory == NULL) goto done;
    /* the tuple (and its floats) is the step's one allocation */
    item = Py_BuildValue(
        "(LLdddOOOO)", self->step, self->tokens, self->wall, self->start, end,
        self->scalars ? self->scalars : Py_None, comm, reduced ? Py_True : Py_False, memory);
    if (item == NULL) goto done;
    PyObject *r = PyObject_CallOneArg(self->pending_append, item);
    if (r == NULL) goto done;
    Py_DECREF(r);
    if (self->flight != Py_None && flight_end(self, end, opened) < 0) goto done;
    if (experts_end(self) < 0) goto done;
    ok = 0;
done:
    Py_XDECREF(comm);
    Py_XDECREF(opened);
    Py_XDECREF(memory);
    Py_XDECREF(item);
    Py_CLEAR(self->scalars);
    return ok;
}

static PyObject *steps_exit(Steps *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *exc_type = nargs > 0 ? args[0] : Py_None;
    self->in_step = 0;
    if (self->slow != NULL) {
        PyObject *slow = self->slow;
        self->slow = NULL;
        PyObject *r = Py_NewRef(Py_None);
        if (exc_type == Py_None) {  /* a step that raised is not a step */
            Py_DECREF(r);
            r = PyObject_CallMethod(
                self->mon, "_end", "OLOO", PyTuple_GET_ITEM(slow, 0), self->tokens, PyTuple_GET_ITEM(slow, 1),
                PyTuple_GET_ITEM(slow, 2));
        }
        Py_DECREF(slow);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        Py_RETURN_FALSE;
    }
    self->fast_now = 0;
    if (exc_type != Py_None) {
        Py_CLEAR(self->scalars);
        Py_RETURN_FALSE;
    }
    if (fast_end(self) < 0) return NULL;
    Py_RETURN_FALSE;
}

/* `s.phase(name)` of an untimed step */
static PyObject *steps_phase(Steps *self, PyObject *name) { return Py_NewRef(the_noop); }

/* `s.log(**scalars)` of an untimed step: references, without a loss's graph */
static PyObject *steps_log(Steps *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "log() takes keyword arguments only: log(loss=..., grad_norm=...)");
        return NULL;
    }
    if (kwargs == NULL) Py_RETURN_NONE;
    if (!self->fast_now) {
        PyErr_SetString(PyExc_RuntimeError, "meshscope: log() outside the step it belongs to");
        return NULL;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
        if (tensor_type == NULL || !PyObject_TypeCheck(value, (PyTypeObject *)tensor_type)) continue;
        int graph = truthy_attr(value, s_requires_grad);
        if (graph < 0) return NULL;
        if (graph) {
            PyObject *bare = PyObject_CallMethodNoArgs(value, s_detach);
            /* replacing the value of a key present does not resize: PyDict_Next stays valid */
            if (bare == NULL || PyDict_SetItem(kwargs, key, bare) < 0) {
                Py_XDECREF(bare);
                return NULL;
            }
            Py_DECREF(bare);
        }
    }
    if (self->scalars == NULL)
        self->scalars = Py_NewRef(kwargs);  /* a fresh dict of this call's: kept as it is */
    else if (PyDict_Update(self->scalars, kwargs) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *steps_get_step(Steps *self, void *unused) { return PyLong_FromLongLong(self->step); }

static int steps_set_step(Steps *self, PyObject *value, void *unused) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "step cannot be deleted");
        return -1;
    }
    long long s = PyLong_AsLongLong(value);
    if (s == -1 && PyErr_Occurred()) return -1;
    self->step = s;
    return 0;
}

static PyObject *steps_get_false(Steps *self, void *unused) { Py_RETURN_FALSE; }
static PyObject *steps_get_phases(Steps *self, void *unused) { return PyDict_New(); }
static PyObject *steps_get_scalars(Steps *self, void *unused) {
    return self->scalars ? Py_NewRef(self->scalars) : PyDict_New();
}
static PyObject *steps_get_fast_now(Steps *self, void *unused) { return PyBool_FromLong(self->fast_now); }

static PyGetSetDef steps_getset[] = {
    {"current", (getter)steps_get_step, (setter)steps_set_step, "The latest step begun.", NULL},
    {"detailed", (getter)steps_get_false, NULL, "An untimed step's phases are not timed.", NULL},
    {"phases", (getter)steps_get_phases, NULL, "An untimed step times no phase.", NULL},
    {"scalars", (getter)steps_get_scalars, NULL, "What the open untimed step logged.", NULL},
    {"fast_now", (getter)steps_get_fast_now, NULL, "Whether an untimed step in C is open.", NULL},
    {NULL}};

static PyMethodDef steps_methods[] = {
    {"step", (PyCFunction)(void (*)(void))steps_call_step, METH_FASTCALL | METH_KEYWORDS,
     "step(tokens=0, step=None): the context of the next step."},
    {"attach", (PyCFunction)steps_attach, METH_VARARGS,
     "attach(flight, watch, meter, experts, fast_ok, host_marks): what the Monitor watches now."},
    {"__enter__", (PyCFunction)steps_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))steps_exit, METH_FASTCALL, NULL},
    {"phase", (PyCFunction)steps_phase, METH_O, "phase(name): an untimed step's phase (a no-op context)."},
    {"log", (PyCFunction)(void (*)(void))steps_log, METH_VARARGS | METH_KEYWORDS,
     "log(**scalars): kept as references, read by the Monitor's service thread."},
    {NULL}};

static PyTypeObject StepsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshscope.collector._fast.Steps",
    .tp_basicsize = sizeof(Steps),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One Monitor's steps: untimed host steps in C, the rest through the Monitor's Python path.",
    .tp_traverse = (traverseproc)steps_traverse,
    .tp_clear = (inquiry)steps_clear,
    .tp_dealloc = (destructor)steps_dealloc,
    .tp_init = (initproc)steps_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = steps_methods,
    .tp_getset = steps_getset,
};

/* --- the flight log's record of a collective issued again and again alike ---------------- */
static Py_ssize_t header_size, record_size, head_size, written_offset;  /* `configure` */

static int put_int64(Py_buffer *view, Py_ssize_t at, int64_t v) {
    if (at < 0 || at + 8 > view->len) {
        PyErr_SetString(PyExc_IndexError, "meshscope: flight log record outside its map");
        return -1;
    }
    memcpy((char *)view->buf + at, &v, 8);  /* little-endian hosts only, as struct's "<" */
    return 0;
}

static int fill_record(PyObject *log, PyObject *name, PyObject *tail, PyObject *step, long long *slot_out) {
    PyObject *seqs = PyObject_GetAttr(log, s_seq), *written = NULL, *capacity = NULL, *map = NULL;
    PyObject *groups = NULL, *at_step = NULL, *value = NULL;
    Py_buffer view = {0};
    int ok = -1;
    if (seqs == NULL || !PyDict_Check(seqs)) goto done;
    PyObject *seq_obj = PyDict_GetItemWithError(seqs, name);
    if (seq_obj == NULL && PyErr_Occurred()) goto done;
    long long seq = seq_obj == NULL ? 0 : PyLong_AsLongLong(seq_obj);
    if (seq == -1 && PyErr_Occurred()) goto done;
    if ((value = PyLong_FromLongLong(seq + 1)) == NULL || PyDict_SetItem(seqs, name, value) < 0) goto done;
    Py_CLEAR(value);
    if ((written = PyObject_GetAttr(log, s_written)) == NULL || (capacity = PyObject_GetAttr(log, s_capacity)) == NULL)
        goto done;
    long long w = PyLong_AsLongLong(written), cap = PyLong_AsLongLong(capacity);
    if (PyErr_Occurred()) goto done;
    if (cap < 1) {
        PyErr_SetString(PyExc_ValueError, "meshscope: flight log capacity must be positive");
        goto done;
    }
    long long slot = w % cap, st;
    if (step == Py_None) {
        if ((at_step = PyObject_GetAttr(log, s_step)) == NULL) goto done;
        st = PyLong_AsLongLong(at_step);
    } else
        st = PyLong_AsLongLong(step);
    if (st == -1 && PyErr_Occurred()) goto done;
    char *bytes;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(tail, &bytes, &n) < 0) goto done;
    if (n != record_size - head_size) {
        PyErr_SetString(PyExc_ValueError, "meshscope: a fixed record's tail has the wrong size");
        goto done;
    }
    if ((map = PyObject_GetAttr(log, s_map)) == NULL || PyObject_GetBuffer(map, &view, PyBUF_WRITABLE) < 0) goto done;
    Py_ssize_t base = header_size + (Py_ssize_t)slot * record_size;
    if (base + record_size > view.len) {
        PyErr_SetString(PyExc_IndexError, "meshscope: flight log record outside its map");
        goto done;
    }
    memcpy((char *)view.buf + base + head_size, bytes, n);
    double issued = clock_seconds(CLOCK_REALTIME), completed = 0.0;
    if (put_int64(&view, base, seq) < 0 || put_int64(&view, base + 8, st) < 0) goto done;
    memcpy((char *)view.buf + base + 16, &issued, 8);
    memcpy((char *)view.buf + base + 24, &completed, 8);
    if ((value = PyLong_FromLongLong(w + 1)) == NULL || PyObject_SetAttr(log, s_written, value) < 0) goto done;
    if (put_int64(&view, written_offset, w + 1) < 0) goto done;
    if ((groups = PyObject_GetAttr(log, s_host_groups)) == NULL) goto done;
    int host = PySequence_Contains(groups, name);
    if (host < 0) goto done;
    if (host) {
        PyObject *slots = PyObject_GetAttr(log, s_host_slots), *key = PyLong_FromLongLong(slot);
        int added = slots != NULL && key != NULL ? PySet_Add(slots, key) : -1;
        Py_XDECREF(slots);
        Py_XDECREF(key);
        if (added < 0) goto done;
    }
    *slot_out = slot;
    ok = 0;
done:
    if (view.buf != NULL) PyBuffer_Release(&view);
    Py_XDECREF(seqs);
    Py_XDECREF(written);
    Py_XDECREF(capacity);
    Py_XDECREF(map);
    Py_XDECREF(groups);
    Py_XDECREF(at_step);
    Py_XDECREF(value);
    return ok;
}

/* `FlightLog.append_fixed(name, tail, step)` under the log's lock: the record's slot */
static PyObject *append_fixed_c(PyObject *log, PyObject *name, PyObject *tail, PyObject *step) {
    PyObject *lock = PyObject_GetAttr(log, s_lock);
    if (lock == NULL) return NULL;
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_acquire);
    if (r == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    Py_DECREF(r);
    long long slot = -1;
    int filled = fill_record(log, name, tail, step, &slot);
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);  /* release whatever happened */
    r = PyObject_CallMethodNoArgs(lock, s_release);
    Py_DECREF(lock);
    if (r == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(type, val, tb);
    if (filled < 0) return NULL;
    return PyLong_FromLongLong(slot);
}

static PyObject *append_fixed(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "append_fixed(log, name, tail, step=None)");
        return NULL;
    }
    return append_fixed_c(args[0], args[1], args[2], nargs == 4 ? args[3] : Py_None);
}

/* --- the model's forward, watched ------------------------------------------------------- */
static PyObject *work_attribute;  /* `collector.moe.WORK_ATTRIBUTE`, set by `configure` */

typedef struct {
    PyObject_HEAD
    PyObject *forward;  /* the model's own forward */
    PyObject *hook;     /* hook(model, args, output), as a forward hook is called */
    PyObject *model;
    PyObject *fast;     /* None, or (steps, watch, experts): untimed steps' watch in C */
    PyObject *dict;     /* __name__, __doc__, __wrapped__, as functools.wraps leaves them */
    /* DDP's reduction record, from its first packing on (`FixedRecord._packed`): its name and
       tail, and its flight log's sequence numbers, lock and queue of opens for the drain */
    PyObject *name, *tail, *seqs, *lock, *opens_append;
    /* a timed host step's backward marks (`BackwardWatch`'s callbacks, bound to this object) */
    PyObject *on_start, *on_local, *on_graph_done, *on_reduced;
} Forward;

static int forward_traverse(Forward *self, visitproc visit, void *arg) {
    Py_VISIT(self->forward);
    Py_VISIT(self->hook);
    Py_VISIT(self->model);
    Py_VISIT(self->fast);
    Py_VISIT(self->dict);
    Py_VISIT(self->name);
    Py_VISIT(self->tail);
    Py_VISIT(self->seqs);
    Py_VISIT(self->lock);
    Py_VISIT(self->opens_append);
    Py_VISIT(self->on_start);
    Py_VISIT(self->on_local);
    Py_VISIT(self->on_graph_done);
    Py_VISIT(self->on_reduced);
    return 0;
}

static int forward_clear(Forward *self) {
    Py_CLEAR(self->forward);
    Py_CLEAR(self->hook);
    Py_CLEAR(self->model);
    Py_CLEAR(self->fast);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->name);
    Py_CLEAR(self->tail);
    Py_CLEAR(self->seqs);
    Py_CLEAR(self->lock);
    Py_CLEAR(self->opens_append);
    Py_CLEAR(self->on_start);
    Py_CLEAR(self->on_local);
    Py_CLEAR(self->on_graph_done);
    Py_CLEAR(self->on_reduced);
    return 0;
}

static void forward_dealloc(Forward *self) {
    PyObject_GC_UnTrack(self);
    forward_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef callback_defs[4]; /* a timed step's backward callbacks, defined below */

static int forward_init(Forward *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"forward", "hook", "model", "fast", NULL};
    PyObject *forward, *hook, *model, *fast = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O", kwlist, &forward, &hook, &model, &fast)) return -1;
    if (fast != Py_None && (!PyTuple_Check(fast) || PyTuple_GET_SIZE(fast) != 3 ||
                            !PyObject_TypeCheck(PyTuple_GET_ITEM(fast, 0), &StepsType))) {
        PyErr_SetString(PyExc_TypeError, "fast: None or (Steps, BackwardWatch, ExpertCounts)");
        return -1;
    }
    forward_clear(self);
    self->forward = Py_NewRef(forward);
    self->hook = Py_NewRef(hook);
    self->model = Py_NewRef(model);
    self->fast = Py_NewRef(fast);
    if ((self->dict = PyDict_New()) == NULL) return -1;
    const char *copied[] = {"__name__", "__qualname__", "__doc__", "__module__", NULL};
    for (int i = 0; copied[i]; i++) {
        PyObject *v = PyObject_GetAttrString(forward, copied[i]);
        if (v == NULL) {
            PyErr_Clear();
            continue;
        }
        int r = PyDict_SetItemString(self->dict, copied[i], v);
        Py_DECREF(v);
        if (r < 0) return -1;
    }
    PyObject **callbacks[] = {&self->on_start, &self->on_local, &self->on_graph_done, &self->on_reduced};
    for (int i = 0; i < 4; i++)
        if ((*callbacks[i] = PyCFunction_New(&callback_defs[i], (PyObject *)self)) == NULL) return -1;
    return PyDict_SetItemString(self->dict, "__wrapped__", forward);
}

/* `ExpertCounts._note_work` where there is work: a layer's `expert_work` that is a tensor with
   elements (`moe.expert_work`). An empty one is remembered per layer (`_idle_work`): a model
   not under expert parallelism keeps one such tensor, so after the first forward this is an
   identity check, no call into torch. */
static int note_work(PyObject *experts, Py_ssize_t layer, PyObject *module) {
    PyObject *work = PyObject_GetAttr(module, work_attribute);
    if (work == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    PyObject *idle = PyObject_GetAttr(experts, s_idle_work);
    int ok = -1;
    if (idle == NULL) goto done;
    int known = PyList_Check(idle) && layer < PyList_GET_SIZE(idle);
    if (work == Py_None || (known && PyList_GET_ITEM(idle, layer) == work)) {
        ok = 0;
        goto done;
    }
    if (tensor_type != NULL && PyObject_TypeCheck(work, (PyTypeObject *)tensor_type)) {
        PyObject *n = PyObject_CallMethod(work, "numel", NULL);
        int some = n == NULL ? -1 : PyObject_IsTrue(n);
        Py_XDECREF(n);
        if (some < 0) goto done;
        if (!some) {
            ok = known ? PyList_SetItem(idle, layer, Py_NewRef(work)) : 0;
            goto done;
        }
    }
    PyObject *r = PyObject_CallMethod(experts, "_note_work", "nO", layer, module);
    if (r == NULL) goto done;
    Py_DECREF(r);
    ok = 0;
done:
    Py_XDECREF(idle);
    Py_DECREF(work);
    return ok;
}

/* `ExpertCounts.forward_done`, its common case: every layer that ran handed out new counts.
   Returns 1 when done, 0 to hand the rest to Python from layer `*from`, -1 on error. */
static int note_counts(PyObject *experts, Py_ssize_t *from) {
    PyObject *layers = PyObject_GetAttr(experts, s_layers), *seen = PyObject_GetAttr(experts, s_seen);
    PyObject *noted = PyObject_GetAttr(experts, s_noted);
    int ok = -1;
    if (layers == NULL || seen == NULL || noted == NULL) goto done;
    if (!PyList_Check(layers) || !PyList_Check(seen) || !PyList_Check(noted) ||
        PyList_GET_SIZE(seen) != PyList_GET_SIZE(layers)) {
        ok = 0;
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(layers); i++) {
        *from = i;
        PyObject *module = PyList_GET_ITEM(layers, i), *was = PyList_GET_ITEM(seen, i);
        if (!PyTuple_Check(was) || PyTuple_GET_SIZE(was) != 2) {
            ok = 0;
            goto done;
        }
        PyObject *counts = PyObject_GetAttr(module, s_counts);
        if (counts == NULL) goto done;
        if (counts == PyTuple_GET_ITEM(was, 0)) {  /* the same tensor: ran only if changed in place */
            Py_DECREF(counts);
            ok = 0;
            goto done;
        }
        PyObject *version = PyObject_GetAttr(counts, s_version);
        if (version == NULL) {
            Py_DECREF(counts);
            if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) goto done;
            PyErr_Clear();  /* an inference tensor keeps no version: Python copies it */
            ok = 0;
            goto done;
        }
        PyObject *note = PyLong_FromSsize_t(i);
        PyObject *entry = note == NULL ? NULL : PyTuple_Pack(3, note, counts, version);
        PyObject *stamp = entry == NULL ? NULL : PyTuple_Pack(2, counts, version);
        Py_XDECREF(note);
        Py_DECREF(counts);
        Py_DECREF(version);
        if (stamp == NULL || PyList_SetItem(seen, i, stamp) < 0) {  /* SetItem takes the stamp */
            Py_XDECREF(entry);
            goto done;
        }
        int appended = PyList_Append(noted, entry);
        Py_DECREF(entry);
        if (appended < 0) goto done;
        if (note_work(experts, i, module) < 0) goto done;
    }
    ok = 1;
done:
    Py_XDECREF(layers);
    Py_XDECREF(seen);
    Py_XDECREF(noted);
    return ok;
}

static int watch_counts(PyObject *watch, PyObject *experts) {
    PyObject *after = PyObject_GetAttr(watch, s_after_forward);
    if (after == NULL) return -1;
    if (after == Py_None) {
        Py_DECREF(after);
        return 0;
    }
    Py_ssize_t from = 0;
    int done = note_counts(experts, &from);
    PyObject *r = NULL;
    if (done == 0)  /* the unusual case, from the layer it was met at */
        r = PyObject_CallMethod(experts, "forward_done", "n", from);
    else if (done > 0)
        r = Py_NewRef(Py_None);
    Py_DECREF(after);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Once DDP's reduction record has packed its fields (its first use, in Python): what opening
   it takes from then on, kept here. */
static int learn_record(Forward *self, PyObject *record) {
    PyObject *packed = PyObject_GetAttr(record, s_packed), *log = NULL;
    int ok = -1;
    if (packed == NULL) return -1;
    if (!PyTuple_Check(packed) || PyTuple_GET_SIZE(packed) != 2) {
        ok = 0;  /* not packed yet */
        goto done;
    }
    if ((log = PyObject_GetAttr(record, s_log)) == NULL) goto done;
    PyObject *seqs = PyObject_GetAttr(log, s_seq), *lock = PyObject_GetAttr(log, s_lock);
    PyObject *opens = PyObject_GetAttr(log, s_opens);
    PyObject *append = opens == NULL ? NULL : PyObject_GetAttrString(opens, "append");
    Py_XDECREF(opens);
    if (seqs == NULL || lock == NULL || append == NULL || !PyDict_Check(seqs)) {
        if (seqs != NULL && !PyDict_Check(seqs)) PyErr_SetString(PyExc_TypeError, "FlightLog._seq must be a dict");
        Py_XDECREF(seqs);
        Py_XDECREF(lock);
        Py_XDECREF(append);
        goto done;
    }
    self->name = Py_NewRef(PyTuple_GET_ITEM(packed, 0));
    self->tail = Py_NewRef(PyTuple_GET_ITEM(packed, 1));
    self->seqs = seqs;
    self->lock = lock;
    self->opens_append = append;
    ok = 0;
done:
    Py_DECREF(packed);
    Py_XDECREF(log);
    return ok;
}

/* DDP's reduction opened now, in step `step`: its sequence number taken under the flight log's
   lock, the record itself queued for the drain to write (`StepMarks.write_opens`): writing
   into the ring after a forward's compute cost the step ~10 us of cache misses here. Returns
   the entry, which the step's end completes. */
static PyObject *issue_open(Forward *self, long long step) {
    PyObject *r = PyObject_CallMethodNoArgs(self->lock, s_acquire);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    long long seq = -1;
    PyObject *had = PyDict_GetItemWithError(self->seqs, self->name), *next = NULL;
    if (had != NULL || !PyErr_Occurred()) {
        seq = had == NULL ? 0 : PyLong_AsLongLong(had);
        if (!(seq == -1 && PyErr_Occurred()) && (next = PyLong_FromLongLong(seq + 1)) != NULL &&
            PyDict_SetItem(self->seqs, self->name, next) < 0)
            seq = -1;
    }
    Py_XDECREF(next);
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    r = PyObject_CallMethodNoArgs(self->lock, s_release);
    if (r == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(type, val, tb);
    if (PyErr_Occurred()) return NULL;
    /* (name, seq, tail, step, issued): `FlightLog._opens` */
    PyObject *entry = Py_BuildValue("(OLOLd)", self->name, seq, self->tail, step, clock_seconds(CLOCK_REALTIME));
    if (entry == NULL) return NULL;
    r = PyObject_CallOneArg(self->opens_append, entry);
    if (r == NULL) {
        Py_DECREF(entry);
        return NULL;
    }
    Py_DECREF(r);
    return entry;
}

/* DDP's reduction record opened now, into the watch's opens that the step's end completes
   (`BackwardWatch.take_open`) */
static int open_reduction(Forward *self, PyObject *watch, PyObject *record) {
    PyObject *opened;
    if (self->opens_append == NULL && learn_record(self, record) < 0) return -1;
    if (self->opens_append == NULL)  /* its first use packs the fields: Python writes it */
        opened = PyObject_CallMethodNoArgs(record, s_begin);
    else
        opened = issue_open(self, ((Steps *)PyTuple_GET_ITEM(self->fast, 0))->step);
    if (opened == NULL) return -1;
    PyObject *open = PyObject_GetAttr(watch, s_open);
    int r = open == NULL ? -1 : PyList_Check(open) ? PyList_Append(open, opened) : -2;
    Py_XDECREF(open);
    Py_DECREF(opened);
    if (r == -2) PyErr_SetString(PyExc_TypeError, "BackwardWatch._open must be a list");
    return r < 0 ? -1 : 0;
}

/* Whether the backward after this forward reduces gradients: 1 yes, 0 no (DDP's no_sync()),
   -2 no backward at all (grad mode off), -1 on error */
static int backward_syncs(Forward *self) {
    PyObject *on = PyObject_CallNoArgs(is_grad_enabled);
    int grad = on == NULL ? -1 : PyObject_IsTrue(on);
    Py_XDECREF(on);
    if (grad <= 0) return grad < 0 ? -1 : -2;
    PyObject *sync = PyObject_GetAttr(self->model, s_sync);
    if (sync == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 1;
    }
    int syncs = PyObject_IsTrue(sync);
    Py_DECREF(sync);
    return syncs;
}

/* `BackwardWatch._on_forward` on an untimed step: counts noted, DDP's reduction record opened */
static int fast_forward(Forward *self) {
    PyObject *watch = PyTuple_GET_ITEM(self->fast, 1), *experts = PyTuple_GET_ITEM(self->fast, 2);
    if (watch_counts(watch, experts) < 0) return -1;
    int syncs = backward_syncs(self);  /* under no_sync() DDP reduces nothing: nothing to record */
    if (syncs <= 0) return syncs == -2 ? 0 : syncs;
    if (PyObject_SetAttr(watch, s_reduced, Py_True) < 0) return -1;
    PyObject *record = PyObject_GetAttr(watch, s_record);
    if (record == NULL) return -1;
    if (record == Py_None) {
        Py_DECREF(record);
        return 0;
    }
    int r = open_reduction(self, watch, record);
    Py_DECREF(record);
    return r;
}

/* --- a timed host step's backward: `BackwardWatch`'s hook and callbacks, in C --------------
   The pre-hook on the output's node fires as backward starts: DDP's reduction record opened
   (left to the drain, completed as the step ends) and an autograd-engine callback queued; the
   engine runs it once the graph is done (compute over), before DDP's finalizer; it marks the
   wait's start and queues one more, which runs after the finalizer (all reduced). */
static PyObject *queue_callback;  /* the autograd engine's `queue_callback`, set by `configure` */

static int queue(PyObject *callback) {
    PyObject *r = PyObject_CallOneArg(queue_callback, callback);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* the meter's wait for communication: its start (0) or end (1), now (`CommMeter.compute_done`) */
static int mark_wait(Forward *self, Py_ssize_t end) {
    PyObject *watch = PyTuple_GET_ITEM(self->fast, 1);
    int timing = truthy_attr(watch, s_timing);
    if (timing <= 0) return timing;
    PyObject *meter = PyObject_GetAttr(watch, s_meter), *window = NULL, *wait = NULL, *now = NULL;
    int ok = -1;
    if (meter == NULL || (window = PyObject_GetAttr(meter, s_window)) == NULL ||
        (wait = PyObject_GetAttr(window, s_wait)) == NULL)
        goto done;
    if (!PyList_Check(wait) || PyList_GET_SIZE(wait) != 2) {
        PyErr_SetString(PyExc_TypeError, "CommWindow.wait must be a list of two marks");
        goto done;
    }
    if ((now = PyFloat_FromDouble(clock_seconds(CLOCK_MONOTONIC))) == NULL ||
        PyObject_SetAttr(meter, s_dirty, Py_True) < 0)
        goto done;
    PyList_SetItem(wait, end, now);  /* takes `now` */
    now = NULL;
    ok = 0;
done:
    Py_XDECREF(meter);
    Py_XDECREF(window);
    Py_XDECREF(wait);
    Py_XDECREF(now);
    return ok;
}

static PyObject *on_backward_start(Forward *self, PyObject *grad_outputs) {
    double started = METER_START();
    PyObject *watch = PyTuple_GET_ITEM(self->fast, 1), *result = NULL;
    PyObject *record = PyObject_GetAttr(watch, s_record);
    if (record == NULL) goto done;
    if (record != Py_None && open_reduction(self, watch, record) < 0) goto done;
    if (queue(self->on_graph_done) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(record);
    METER_ADD(marks_seconds, marks_calls, started);
    return result;
}

static PyObject *on_local_backward(Forward *self, PyObject *grad_outputs) {
    double started = METER_START();
    PyObject *result = queue(self->on_graph_done) < 0 ? NULL : Py_NewRef(Py_None);
    METER_ADD(marks_seconds, marks_calls, started);
    return result;
}

static PyObject *on_graph_done(Forward *self, PyObject *unused) {
    double started = METER_START();
    PyObject *result = mark_wait(self, 0) < 0 || queue(self->on_reduced) < 0 ? NULL : Py_NewRef(Py_None);
    METER_ADD(marks_seconds, marks_calls, started);
    return result;
}

static PyObject *on_reduced(Forward *self, PyObject *unused) {
    double started = METER_START();
    PyObject *result = mark_wait(self, 1) < 0 ? NULL : Py_NewRef(Py_None);
    METER_ADD(marks_seconds, marks_calls, started);
    return result;
}

static PyMethodDef callback_defs[4] = {
    {"on_backward_start", (PyCFunction)on_backward_start, METH_O, NULL},
    {"on_local_backward", (PyCFunction)on_local_backward, METH_O, NULL},
    {"on_graph_done", (PyCFunction)on_graph_done, METH_NOARGS, NULL},
    {"on_reduced", (PyCFunction)on_reduced, METH_NOARGS, NULL},
};

/* `BackwardWatch.forward_ended` on a timed host step, its common case (a tensor out): 0 when
   done, 1 to leave it to Python, -1 on error */
static int timed_forward(Forward *self, PyObject *output) {
    Steps *steps = (Steps *)PyTuple_GET_ITEM(self->fast, 0);
    PyObject *watch = PyTuple_GET_ITEM(self->fast, 1);
    if (!steps->host_marks || !steps->in_step || tensor_type == NULL ||
        !PyObject_TypeCheck(output, (PyTypeObject *)tensor_type))
        return 1;
    int timing = truthy_attr(watch, s_timing);
    if (timing <= 0) return timing < 0 ? -1 : 1;  /* an untimed step in Python: its record there */
    int syncs = backward_syncs(self);
    if (syncs < 0) return syncs == -2 ? 0 : syncs;
    if (syncs && PyObject_SetAttr(watch, s_reduced, Py_True) < 0) return -1;
    PyObject *node = PyObject_GetAttr(output, s_grad_fn);
    if (node == NULL) return -1;
    PyObject *r = node == Py_None ? Py_NewRef(Py_None)
                                  : PyObject_CallMethodOneArg(node, s_register_prehook, syncs ? self->on_start : self->on_local);
    Py_DECREF(node);
    Py_XDECREF(r);  /* the hook's handle: it goes with the graph */
    return r == NULL ? -1 : 0;
}

static PyObject *forward_call(Forward *self, PyObject *args, PyObject *kwargs) {
    PyObject *output = PyObject_Call(self->forward, args, kwargs), *r;
    if (output == NULL) return NULL;
    if (self->fast == Py_None) {  /* a plain watch: the hook does it all */
        r = PyObject_CallFunctionObjArgs(self->hook, self->model, args, output, NULL);
    } else {  /* the Monitor's: counts noted here; on an untimed step in C, all of it */
        int untimed = ((Steps *)PyTuple_GET_ITEM(self->fast, 0))->fast_now;
        double started = METER_START();
        int done = untimed ? fast_forward(self) : watch_counts(PyTuple_GET_ITEM(self->fast, 1), PyTuple_GET_ITEM(self->fast, 2));
        if (done == 0 && !untimed) done = timed_forward(self, output);  /* 1: left to Python */
        METER_ADD(metered_seconds, metered_calls, started);
        if (done < 0)
            r = NULL;
        else if (done == 0)
            r = Py_NewRef(Py_None);
        else  /* a forward outside a step, or on a device: its hook and callbacks, in Python */
            r = PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(self->fast, 1), s_forward_ended, self->model, output, NULL);
    }
    if (r == NULL) {
        Py_DECREF(output);
        return NULL;
    }
    Py_DECREF(r);
    return output;
}

static PyObject *forward_get_dict(Forward *self, void *unused) { return Py_NewRef(self->dict); }

static PyGetSetDef forward_getset[] = {
    {"__dict__", (getter)forward_get_dict, NULL, "What functools.wraps would copy.", NULL}, {NULL}};

static PyTypeObject ForwardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshscope.collector._fast.Forward",
    .tp_basicsize = sizeof(Forward),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A model's forward, then hook(model, args, output): a forward hook without nn.Module's slow path.",
    .tp_traverse = (traverseproc)forward_traverse,
    .tp_clear = (inquiry)forward_clear,
    .tp_dealloc = (destructor)forward_dealloc,
    .tp_init = (initproc)forward_init,
    .tp_new = PyType_GenericNew,
    .tp_call = (ternaryfunc)forward_call,
    .tp_getset = forward_getset,
    .tp_dictoffset = offsetof(Forward, dict),
};

/* --- module ------------------------------------------------------------------------------ */
static PyObject *configure(PyObject *mod, PyObject *args) {
    PyObject *tensor, *grad_enabled, *queue, *work;
    if (!PyArg_ParseTuple(args, "OOOUnnnn", &tensor, &grad_enabled, &queue, &work, &header_size, &record_size,
                          &head_size, &written_offset))
        return NULL;
    if (head_size != 32 || record_size <= head_size) {
        PyErr_SetString(PyExc_ValueError, "meshscope: a record's head is (seq, step, issued, done): 32 bytes");
        return NULL;
    }
    Py_XSETREF(tensor_type, Py_NewRef(tensor));
    Py_XSETREF(is_grad_enabled, Py_NewRef(grad_enabled));
    Py_XSETREF(work_attribute, Py_NewRef(work));
    Py_XSETREF(queue_callback, Py_NewRef(queue));
    Py_RETURN_NONE;
}

static PyObject *meter(PyObject *mod, PyObject *on) {
    int t = PyObject_IsTrue(on);
    if (t < 0) return NULL;
    metering = t;
    metered_seconds = marks_seconds = 0.0;
    metered_calls = marks_calls = 0;
    Py_RETURN_NONE;
}

static PyObject *metered(PyObject *mod, PyObject *unused) {
    return Py_BuildValue("{s(dL)s(dL)}", "Forward (C)", metered_seconds, metered_calls, "Backward marks (C)",
                         marks_seconds, marks_calls);
}

static PyMethodDef module_methods[] = {
    {"meter", meter, METH_O, "meter(on): meter the forward watch's C body from now (a benchmark's account)."},
    {"metered", metered, METH_NOARGS, "{entry: (thread CPU seconds, calls)} since meter(True)."},
    {"configure", configure, METH_VARARGS,
     "configure(torch.Tensor, torch.is_grad_enabled, queue_callback, WORK_ATTRIBUTE, HEADER_SIZE, RECORD.size, "
     "RECORD_HEAD.size, "
     "WRITTEN_OFFSET): what C checks against and writes."},
    {"append_fixed", (PyCFunction)(void (*)(void))append_fixed, METH_FASTCALL,
     "append_fixed(log, name, tail, step=None): FlightLog.append_fixed, its slot."},
    {NULL}};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT, "meshscope.collector._fast",
    "The Monitor's untimed host steps in C (see the source's head).", -1, module_methods};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__fast(void) {
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_detach, "detach");
    INTERN(s_begin, "begin");
    INTERN(s_end, "end");
    INTERN(s_step_ended, "step_ended");
    INTERN(s_take, "take");
    INTERN(s_dirty, "_dirty");
    INTERN(s_reduced, "_reduced");
    INTERN(s_open, "_open");
    INTERN(s_memory, "_memory");
    INTERN(s_polled, "_polled");
    INTERN(s_settle_polled, "settle_polled");
    INTERN(s_written, "_written");
    INTERN(s_step, "_step");
    INTERN(s_timing, "timing");
    INTERN(s_in_flight, "_in_flight");
    INTERN(s_layers, "layers");
    INTERN(s_every, "every");
    INTERN(s_map, "_map");
    INTERN(s_counts, "expert_token_counts");
    INTERN(s_version, "_version");
    INTERN(s_is_inference, "is_inference");
    INTERN(s_seen, "_seen");
    INTERN(s_noted, "_noted");
    INTERN(s_forward_done, "forward_done");
    INTERN(s_record, "record");
    INTERN(s_sync, "require_backward_grad_sync");
    INTERN(s_packed, "_packed");
    INTERN(s_log, "log");
    INTERN(s_seq, "_seq");
    INTERN(s_lock, "_lock");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_capacity, "capacity");
    INTERN(s_host_groups, "_host_groups");
    INTERN(s_host_slots, "_host_slots");
    INTERN(s_after_forward, "after_forward");
    INTERN(s_idle_work, "_idle_work");
    INTERN(s_opens, "_opens");
    INTERN(s_forward_ended, "forward_ended");
    INTERN(s_off_thread, "_off_thread");
    INTERN(s_append, "append");
    INTERN(s_meter, "meter");
    INTERN(s_window, "_window");
    INTERN(s_wait, "wait");
    INTERN(s_grad_fn, "grad_fn");
    INTERN(s_register_prehook, "register_prehook");
    INTERN(s_work, "_work");
    INTERN(s_handed, "_handed");
    if (PyType_Ready(&NoOpType) < 0 || PyType_Ready(&PhaseType) < 0 || PyType_Ready(&StepsType) < 0 ||
        PyType_Ready(&ForwardType) < 0)
        return NULL;
    the_noop = PyObject_CallNoArgs((PyObject *)&NoOpType);
    if (the_noop == NULL) return NULL;
    PyObject *m = PyModule_Create(&fast_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Steps", (PyObject *)&StepsType) < 0 ||
        PyModule_AddObjectRef(m, "NoOp", (PyObject *)&NoOpType) < 0 ||
        PyModule_AddObjectRef(m, "Forward", (PyObject *)&ForwardType) < 0 ||
        PyModule_AddObjectRef(m, "Phase", (PyObject *)&PhaseType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
