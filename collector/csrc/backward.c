/* A timed host step's backward marks, in C (see fast.h). */
#include "fast.h"

/* --- a timed host step's backward: `BackwardWatch`'s hook and callbacks, in C --------------
   The pre-hook on the output's node fires as backward starts: DDP's reduction record opened
   (left to the drain, completed as the step ends) and an autograd-engine callback queued; the
   engine runs it once the graph is done (compute over), before DDP's finalizer; it marks the
   wait's start and queues one more, which runs after the finalizer (all reduced). */

static int queue(PyObject *callback) {
    PyObject *r = PyObject_CallOneArg(queue_callback, callback);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* the meter's wait for communication: its start (0) or end (1), now (`CommMeter.compute_done`) */
static int mark_wait(Forward *self, Py_ssize_t end) {
    Steps *steps = (Steps *)PyTuple_GET_ITEM(self->fast, 0);
    PyObject *watch = PyTuple_GET_ITEM(self->fast, 1);
    if (!steps->timing) return 0;
    PyObject *meter = PyObject_GetAttr(watch, s_meter), *window = NULL, *wait = NULL, *now = NULL;
    int ok = -1;
    if (meter == NULL || (window = PyObject_GetAttr(meter, s_window)) == NULL ||
        (wait = PyObject_GetAttr(window, s_wait)) == NULL)
        goto done;
    if (!PyList_Check(wait) || PyList_GET_SIZE(wait) != 2) {
        PyErr_SetString(PyExc_TypeError, "CommWindow.wait must be a list of two marks");
        goto done;
    }
    if ((now = PyFloat_FromDouble(clock_seconds(CLOCK_MONOTONIC))) == NULL) goto done;
    steps->dirty = 1;
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
    PyObject *record = ((Steps *)PyTuple_GET_ITEM(self->fast, 0))->record, *result = NULL;
    if (record != Py_None && open_reduction(self, record) < 0) goto done;
    if (queue(self->on_graph_done) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
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

PyMethodDef callback_defs[4] = {
    {"on_backward_start", (PyCFunction)on_backward_start, METH_O, NULL},
    {"on_local_backward", (PyCFunction)on_local_backward, METH_O, NULL},
    {"on_graph_done", (PyCFunction)on_graph_done, METH_NOARGS, NULL},
    {"on_reduced", (PyCFunction)on_reduced, METH_NOARGS, NULL},
};

/* `BackwardWatch.forward_ended` on a timed host step, its common case (a tensor out): 0 when
   done, 1 to leave it to Python, -1 on error */
int timed_forward(Forward *self, PyObject *output) {
    Steps *steps = (Steps *)PyTuple_GET_ITEM(self->fast, 0);
    if (!steps->host_marks || !steps->in_step || tensor_type == NULL ||
        !PyObject_TypeCheck(output, (PyTypeObject *)tensor_type))
        return 1;
    if (!steps->timing) return 1;  /* an untimed step in Python: its record there */
    int syncs = backward_syncs(self);
    if (syncs < 0) return syncs == -2 ? 0 : syncs;
    if (syncs) steps->reduced = 1;
    PyObject *node = PyObject_GetAttr(output, s_grad_fn);
    if (node == NULL) return -1;
    PyObject *r = node == Py_None ? Py_NewRef(Py_None)
                                  : PyObject_CallMethodOneArg(node, s_register_prehook, syncs ? self->on_start : self->on_local);
    Py_DECREF(node);
    Py_XDECREF(r);  /* the hook's handle: it goes with the graph */
    return r == NULL ? -1 : 0;
}
