/* The steps of one Monitor: `mon.step(...)`'s context, host steps in C (see fast.h). */
#include "fast.h"

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
    Py_VISIT(self->phases);
    Py_VISIT(self->polled);
    Py_VISIT(self->memory);
    Py_VISIT(self->opened);
    Py_VISIT(self->layers);
    Py_VISIT(self->seen);
    Py_VISIT(self->noted);
    Py_VISIT(self->idle);
    Py_VISIT(self->record);
    Py_VISIT(self->map);
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
    Py_CLEAR(self->phases);
    Py_CLEAR(self->polled);
    Py_CLEAR(self->memory);
    Py_CLEAR(self->opened);
    Py_CLEAR(self->layers);
    Py_CLEAR(self->seen);
    Py_CLEAR(self->noted);
    Py_CLEAR(self->idle);
    Py_CLEAR(self->record);
    Py_CLEAR(self->map);
    return 0;
}

static void steps_dealloc(Steps *self) {
    PyObject_GC_UnTrack(self);
    steps_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int steps_init(Steps *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"monitor",     "pending",         "detail_every",   "memory_every",
                             "step_offset", "progress_offset", "reached_offset", NULL};
    PyObject *mon, *pending;
    long long detail, memory;
    Py_ssize_t offset, progress = -1, reached = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLLn|nn", kwlist, &mon, &pending, &detail, &memory, &offset,
                                     &progress, &reached))
        return -1;
    if ((progress < 0) != (reached < 0)) {
        PyErr_SetString(PyExc_ValueError, "progress_offset and reached_offset come together");
        return -1;
    }
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
    self->progress_offset = progress;
    self->reached_offset = reached;
    self->step = -1;
    self->timing = 1;
    self->expert_sum_due = 1;
    self->polled = Py_NewRef(Py_None);
    if ((self->memory = PyDict_New()) == NULL || (self->opened = PyList_New(0)) == NULL) return -1;
    return 0;
}

/* The expert counts the forward's watch notes into: their lists, kept (see `layers`) */
static int attach_experts(Steps *self, PyObject *experts) {
    PyObject *every = PyObject_GetAttr(experts, s_every);
    long long e = every == NULL ? -1 : PyLong_AsLongLong(every);
    Py_XDECREF(every);
    if (e < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ExpertCounts.every must be at least 1");
        return -1;
    }
    PyObject *names[4] = {s_layers, s_seen, s_noted, s_idle_work}, *lists[4] = {NULL};
    for (int i = 0; i < 4; i++)
        if ((lists[i] = PyObject_GetAttr(experts, names[i])) == NULL || !PyList_Check(lists[i])) {
            if (lists[i] != NULL) PyErr_Format(PyExc_TypeError, "ExpertCounts.%U must be a list", names[i]);
            for (int j = 0; j <= i; j++) Py_XDECREF(lists[j]);
            return -1;
        }
    Py_XSETREF(self->layers, lists[0]);
    Py_XSETREF(self->seen, lists[1]);
    Py_XSETREF(self->noted, lists[2]);
    Py_XSETREF(self->idle, lists[3]);
    Py_XSETREF(self->experts, Py_NewRef(experts));
    self->expert_layers = PyList_GET_SIZE(self->layers);
    self->expert_every = e;
    return 0;
}

/* The flight log whose header gets the step and whose queues get the step's end: what a step
   touches of it, kept (each object one for the log's life) */
static int attach_flight(Steps *self, PyObject *flight) {
    PyObject *ends_append = Py_NewRef(Py_None), *polled = Py_NewRef(Py_None), *map = Py_NewRef(Py_None);
    if (flight != Py_None) {
        Py_SETREF(polled, PyObject_GetAttr(flight, s_polled));
        Py_SETREF(map, PyObject_GetAttr(flight, s_map));
        PyObject *ends = PyObject_GetAttrString(flight, "_ends");
        Py_SETREF(ends_append, ends == NULL ? NULL : PyObject_GetAttrString(ends, "append"));
        Py_XDECREF(ends);
        if (ends_append == NULL || polled == NULL || map == NULL || !PyList_Check(polled)) {
            if (polled != NULL && !PyList_Check(polled)) PyErr_SetString(PyExc_TypeError, "FlightLog._polled must be a list");
            Py_XDECREF(ends_append);
            Py_XDECREF(polled);
            Py_XDECREF(map);
            return -1;
        }
    }
    Py_XSETREF(self->map, map);
    Py_XSETREF(self->ends_append, ends_append);
    Py_XSETREF(self->polled, polled);
    return 0;
}

/* `attach(flight, watch, meter, experts, fast_ok, host_marks, comm_every, host_memory)`: what
   the Monitor watches now */
static PyObject *steps_attach(Steps *self, PyObject *args) {
    PyObject *flight, *watch, *meter, *experts;
    int ok, host_marks, host_memory;
    long long comm_every;
    if (!PyArg_ParseTuple(args, "OOOOppLp", &flight, &watch, &meter, &experts, &ok, &host_marks, &comm_every,
                          &host_memory))
        return NULL;
    if (comm_every < 1) {
        PyErr_SetString(PyExc_ValueError, "comm_every must be at least 1");
        return NULL;
    }
    if (attach_flight(self, flight) < 0) return NULL;
    Py_XSETREF(self->flight, Py_NewRef(flight));
    Py_XSETREF(self->watch, Py_NewRef(watch));
    Py_XSETREF(self->meter, Py_NewRef(meter));
    if (attach_experts(self, experts) < 0) return NULL;
    PyObject *record = watch == Py_None ? Py_NewRef(Py_None) : PyObject_GetAttr(watch, s_record);
    if (record == NULL) return NULL;
    Py_XSETREF(self->record, record);
    self->fast_ok = ok;
    self->host_marks = host_marks;
    self->host_memory = host_memory;
    self->comm_every = comm_every;
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

/* The step, into the flight log's header: where the log keeps it (`StepMarks.step`) */
static int set_flight_step(Steps *self, long long step) {
    Py_buffer view;
    if (PyObject_GetBuffer(self->map, &view, PyBUF_WRITABLE) < 0) {  /* a closed log: nothing to tell */
        PyErr_Clear();
        return 0;
    }
    if (view.len >= self->step_offset + 8) {
        int64_t s = step;
        memcpy((char *)view.buf + self->step_offset, &s, 8);  /* little-endian hosts only (x86, arm) */
    }
    PyBuffer_Release(&view);
    return 0;
}

/* The step that ended and when, into the flight log's header at once (`StepMarks.reached`):
   the hang watchdog's progress, as fresh as the step whatever the drain's cadence */
int set_flight_progress(Steps *self, long long step, double at) {
    Py_buffer view;
    if (self->progress_offset < 0) return 0;
    if (PyObject_GetBuffer(self->map, &view, PyBUF_WRITABLE) < 0) {  /* a closed log: nothing to tell */
        PyErr_Clear();
        return 0;
    }
    if (view.len >= self->progress_offset + 8 && view.len >= self->reached_offset + 8) {
        int64_t s = step;
        memcpy((char *)view.buf + self->progress_offset, &at, 8);  /* little-endian hosts only */
        memcpy((char *)view.buf + self->reached_offset, &s, 8);
    }
    PyBuffer_Release(&view);
    return 0;
}

/* A timed step's start (`Monitor._begin`'s): communication outside a step is not its own
   (e.g. DDP's init broadcast), its buckets timed when sampled; its phases timed into a dict */
static int begin_timed(Steps *self) {
    PyObject *sample = self->step % self->comm_every == 0 ? Py_True : Py_False;
    PyObject *r = PyObject_CallMethodOneArg(self->meter, s_take, sample);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return (self->phases = PyDict_New()) == NULL ? -1 : 0;
}

/* A memory read due on this step, as the host probe's (`HostProbe.memory`): the steps until
   the next carry it (`Monitor._memory`) */
static int read_memory(Steps *self) {
    PyObject *memory = Py_BuildValue("{s:i,s:i,s:L}", "allocated", 0, "reserved", 0, "rss", rss_bytes());
    if (memory == NULL) return -1;
    Py_SETREF(self->memory, memory);
    return 0;
}

/* This step's communication (`Monitor._take_comm`): a timed step's window, an untimed one's
   only where a hook counted in it (None: the drain makes an empty one). Sets `reduced` where
   the drain adds DDP's bytes. */
static PyObject *take_comm(Steps *self, int *reduced) {
    *reduced = 0;
    PyObject *comm = self->phases != NULL || self->dirty ? PyObject_CallMethodOneArg(self->meter, s_take, Py_False)
                                                         : Py_NewRef(Py_None);
    if (comm == NULL || self->watch == Py_None) return comm;
    *reduced = self->reduced;
    self->reduced = 0;
    return comm;
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
    int detailed = step % self->detail_every == 0, memory = step % self->memory_every == 0;
    int fast = self->fast_ok && (!detailed || self->host_marks) && (!memory || self->host_memory);
    if (!fast) {  /* the Python path: it sets the step through the Monitor's `_step` */
        self->expert_sum_due = 1;  /* its end may start an expert window's sum */
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
    if (self->flight != Py_None && set_flight_step(self, step) < 0) return NULL;
    self->timing = detailed;
    Py_CLEAR(self->scalars);
    Py_CLEAR(self->phases);
    if (detailed && begin_timed(self) < 0) return NULL;
    self->memory_due = memory;
    self->wall = clock_seconds(CLOCK_REALTIME);
    self->start = clock_seconds(CLOCK_MONOTONIC);
    self->fast_now = self->in_step = 1;
    return Py_NewRef(self);
}

static int fast_end(Steps *self) {
    double end = clock_seconds(CLOCK_MONOTONIC);
    PyObject *comm = NULL, *opened = NULL, *item = NULL;
    int reduced = 0, ok = -1;
    if (self->memory_due && read_memory(self) < 0) goto done;
    if ((comm = take_comm(self, &reduced)) == NULL) goto done;
    opened = self->watch != Py_None ? take_open(self) : Py_NewRef(Py_None);
    if (opened == NULL) goto done;
    /* the tuple (and its floats) is an untimed step's one allocation */
    item = Py_BuildValue(
        "(LLdddOOOOO)", self->step, self->tokens, self->wall, self->start, end,
        self->scalars ? self->scalars : Py_None, comm, reduced ? Py_True : Py_False, self->memory,
        self->phases ? self->phases : Py_None);
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
    Py_XDECREF(item);
    Py_CLEAR(self->scalars);
    Py_CLEAR(self->phases);
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
        Py_CLEAR(self->phases);
        Py_RETURN_FALSE;
    }
    if (fast_end(self) < 0) return NULL;
    Py_RETURN_FALSE;
}

/* `s.phase(name)`: a timed step's two marks, an untimed step's no-op */
static PyObject *steps_phase(Steps *self, PyObject *name) {
    if (self->phases != NULL && self->fast_now)
        return PyObject_CallFunctionObjArgs((PyObject *)&PhaseType, self->phases, name, NULL);
    return Py_NewRef(the_noop);
}

/* `s.log(**scalars)`: references, without a loss's graph */
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
            PyObject *bare = PyObject_GetAttr(value, s_data); /* no dispatch, unlike detach() */
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

/* the step state's fields (`collector.stepstate.StepState`), for the Python path */
/* a field of the step state set from Python: a `type` only */
static int set_field(PyObject **field, PyObject *value, PyTypeObject *type, const char *name) {
    if (value == NULL || !PyObject_TypeCheck(value, type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a %s", name, type->tp_name);
        return -1;
    }
    Py_SETREF(*field, Py_NewRef(value));
    return 0;
}
static PyObject *steps_get_memory(Steps *self, void *unused) { return Py_NewRef(self->memory); }
static int steps_set_memory(Steps *self, PyObject *v, void *unused) {
    return set_field(&self->memory, v, &PyDict_Type, "memory");
}
static PyObject *steps_get_opened(Steps *self, void *unused) { return Py_NewRef(self->opened); }
static int steps_set_opened(Steps *self, PyObject *v, void *unused) {
    return set_field(&self->opened, v, &PyList_Type, "opened");
}
static int set_flag(int *flag, PyObject *value) {
    int t = value == NULL ? -1 : PyObject_IsTrue(value);
    if (t < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a flag cannot be deleted");
        return -1;
    }
    *flag = t;
    return 0;
}
static PyObject *steps_get_timing(Steps *self, void *unused) { return PyBool_FromLong(self->timing); }
static int steps_set_timing(Steps *self, PyObject *v, void *unused) { return set_flag(&self->timing, v); }
static PyObject *steps_get_reduced(Steps *self, void *unused) { return PyBool_FromLong(self->reduced); }
static int steps_set_reduced(Steps *self, PyObject *v, void *unused) { return set_flag(&self->reduced, v); }
static PyObject *steps_get_dirty(Steps *self, void *unused) { return PyBool_FromLong(self->dirty); }
static int steps_set_dirty(Steps *self, PyObject *v, void *unused) { return set_flag(&self->dirty, v); }

static PyObject *steps_get_detailed(Steps *self, void *unused) { return PyBool_FromLong(self->phases != NULL); }
static PyObject *steps_get_phases(Steps *self, void *unused) {
    return self->phases ? Py_NewRef(self->phases) : PyDict_New();
}
static PyObject *steps_get_scalars(Steps *self, void *unused) {
    return self->scalars ? Py_NewRef(self->scalars) : PyDict_New();
}
static PyObject *steps_get_fast_now(Steps *self, void *unused) { return PyBool_FromLong(self->fast_now); }

static PyGetSetDef steps_getset[] = {
    {"current", (getter)steps_get_step, (setter)steps_set_step, "The latest step begun.", NULL},
    {"memory", (getter)steps_get_memory, (setter)steps_set_memory, "The latest memory reading.", NULL},
    {"timing", (getter)steps_get_timing, (setter)steps_set_timing, "The step in progress is timed.", NULL},
    {"reduced", (getter)steps_get_reduced, (setter)steps_set_reduced, "A backward reduced since the last take.", NULL},
    {"opened", (getter)steps_get_opened, (setter)steps_set_opened, "Records untimed forwards opened.", NULL},
    {"dirty", (getter)steps_get_dirty, (setter)steps_set_dirty, "The comm window holds something.", NULL},
    {"detailed", (getter)steps_get_detailed, NULL, "Whether the open step's phases are timed.", NULL},
    {"phases", (getter)steps_get_phases, NULL, "The open step's timed phases ({} untimed).", NULL},
    {"scalars", (getter)steps_get_scalars, NULL, "What the open step in C logged.", NULL},
    {"fast_now", (getter)steps_get_fast_now, NULL, "Whether a step in C is open.", NULL},
    {NULL}};

static PyMethodDef steps_methods[] = {
    {"step", (PyCFunction)(void (*)(void))steps_call_step, METH_FASTCALL | METH_KEYWORDS,
     "step(tokens=0, step=None): the context of the next step."},
    {"attach", (PyCFunction)steps_attach, METH_VARARGS,
     "attach(flight, watch, meter, experts, fast_ok, host_marks, comm_every, host_memory): what the Monitor "
     "watches now."},
    {"__enter__", (PyCFunction)steps_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))steps_exit, METH_FASTCALL, NULL},
    {"phase", (PyCFunction)steps_phase, METH_O, "phase(name): a timed step's phase, an untimed step's no-op context."},
    {"log", (PyCFunction)(void (*)(void))steps_log, METH_VARARGS | METH_KEYWORDS,
     "log(**scalars): kept as references, read by the Monitor's service thread."},
    {NULL}};

PyTypeObject StepsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshscope.collector._fast.Steps",
    .tp_basicsize = sizeof(Steps),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One Monitor's steps: host steps in C, the rest through the Monitor's Python path.",
    .tp_traverse = (traverseproc)steps_traverse,
    .tp_clear = (inquiry)steps_clear,
    .tp_dealloc = (destructor)steps_dealloc,
    .tp_init = (initproc)steps_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = steps_methods,
    .tp_getset = steps_getset,
};
