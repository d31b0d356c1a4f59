/* The watch on a model's forward, in C (see fast.h). */
#include "fast.h"

/* --- the model's forward, watched ------------------------------------------------------- */

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
   identity check, no call into torch; a layer with none is remembered as False. */
static int note_work(Steps *steps, Py_ssize_t layer, PyObject *module) {
    PyObject *idle = steps->idle, *experts = steps->experts;
    int known = layer < PyList_GET_SIZE(idle);
    if (known && PyList_GET_ITEM(idle, layer) == Py_False) return 0;  /* it has none */
    PyObject *work = PyObject_GetAttr(module, work_attribute);
    if (work == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        /* a layer without one at a forward's end has none (the protocol sets it at build or in
           every forward): not asked again, where nn.Module's __getattr__ raises each time */
        return known ? PyList_SetItem(idle, layer, Py_NewRef(Py_False)) : 0;
    }
    int ok = -1;
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
    Py_DECREF(work);
    return ok;
}

/* `ExpertCounts.forward_done`, its common case: every layer that ran handed out new counts.
   Returns 1 when done, 0 to hand the rest to Python from layer `*from`, -1 on error. */
static int note_counts(Steps *steps, Py_ssize_t *from) {
    PyObject *layers = steps->layers, *seen = steps->seen, *noted = steps->noted;
    int ok = -1;
    if (PyList_GET_SIZE(seen) != PyList_GET_SIZE(layers)) {
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
        if (note_work(steps, i, module) < 0) goto done;
    }
    ok = 1;
done:
    return ok;
}

/* the watch's `after_forward` (`ExpertCounts.forward_done`, where the model has MoE layers) */
static int watch_counts(Steps *steps) {
    if (steps->expert_layers == 0) return 0;
    Py_ssize_t from = 0;
    int done = note_counts(steps, &from);
    if (done != 0) return done < 0 ? -1 : 0;
    /* the unusual case, from the layer it was met at */
    PyObject *r = PyObject_CallMethod(steps->experts, "forward_done", "n", from);
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
    if (lock_take(self->lock) < 0) return NULL;
    long long seq = -1;
    int taken = take_seq(self->seqs, self->name, &seq);
    if (release(self->lock) < 0 || taken < 0) return NULL;
    /* (name, seq, tail, step, issued): `FlightLog._opens` */
    PyObject *entry = Py_BuildValue("(OLOLd)", self->name, seq, self->tail, step, clock_seconds(CLOCK_REALTIME));
    if (entry == NULL) return NULL;
    PyObject *r = PyObject_CallOneArg(self->opens_append, entry);
    if (r == NULL) {
        Py_DECREF(entry);
        return NULL;
    }
    Py_DECREF(r);
    return entry;
}

/* DDP's reduction record opened now, into the watch's opens that the step's end completes
   (`BackwardWatch.take_open`) */
int open_reduction(Forward *self, PyObject *record) {
    Steps *steps = (Steps *)PyTuple_GET_ITEM(self->fast, 0);
    PyObject *opened;
    if (self->opens_append == NULL && learn_record(self, record) < 0) return -1;
    if (self->opens_append == NULL)  /* its first use packs the fields: Python writes it */
        opened = PyObject_CallMethodNoArgs(record, s_begin);
    else
        opened = issue_open(self, steps->step);
    if (opened == NULL) return -1;
    int r = PyList_Append(steps->opened, opened);
    Py_DECREF(opened);
    return r;
}

/* Whether the backward after this forward reduces gradients: 1 yes, 0 no (DDP's no_sync()),
   -2 no backward at all (grad mode off), -1 on error */
int backward_syncs(Forward *self) {
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
    Steps *steps = (Steps *)PyTuple_GET_ITEM(self->fast, 0);
    if (watch_counts(steps) < 0) return -1;
    int syncs = backward_syncs(self);  /* under no_sync() DDP reduces nothing: nothing to record */
    if (syncs <= 0) return syncs == -2 ? 0 : syncs;
    steps->reduced = 1;
    return steps->record == Py_None ? 0 : open_reduction(self, steps->record);
}

static PyObject *forward_call(Forward *self, PyObject *args, PyObject *kwargs) {
    PyObject *output = PyObject_Call(self->forward, args, kwargs), *r;
    if (output == NULL) return NULL;
    if (self->fast == Py_None) {  /* a plain watch: the hook does it all */
        r = PyObject_CallFunctionObjArgs(self->hook, self->model, args, output, NULL);
    } else {  /* the Monitor's: counts noted here; on an untimed step in C, all of it */
        Steps *steps = (Steps *)PyTuple_GET_ITEM(self->fast, 0);
        int untimed = steps->fast_now && steps->phases == NULL;
        double started = METER_START();
        int done = untimed ? fast_forward(self) : watch_counts(steps);
        if (done == 0 && !untimed) done = timed_forward(self, output);  /* 1: left to Python */
        METER_ADD(metered_seconds, metered_calls, started);
        if (metering) {  /* the meter's own cost, right after the body's (cold alike) */
            double probe = METER_START();
            METER_ADD(probe_seconds, probe_calls, probe);
        }
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

PyTypeObject ForwardType = {
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
