/* What an untimed step's end hands over: DDP's records to complete, the flight log's step end, a closed expert window (see fast.h). */
#include "fast.h"

/* the slots of the records an untimed forward opened (`BackwardWatch.take_open`), or NULL */
PyObject *take_open(Steps *self) {
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

int flight_end(Steps *self, double end, PyObject *opened) {
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
int experts_end(Steps *self) {
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
