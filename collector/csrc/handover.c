/* What a step's end in C hands over: DDP's records to complete, the flight log's step end, a closed expert window (see fast.h). */
#include "fast.h"

/* the slots of the records an untimed forward opened (`BackwardWatch.take_open`), or NULL */
PyObject *take_open(Steps *self) {
    if (PyList_GET_SIZE(self->opened) == 0) return Py_NewRef(Py_None);  /* a list: its setter says so */
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) return NULL;
    PyObject *opened = self->opened;
    self->opened = fresh;
    return opened;
}

/* The flight log's count of records written, where the step's end needs it: a slot written
   as it was issued (not C's own open, a tuple) is found in the ring by it */
static PyObject *written_for(Steps *self, PyObject *opened) {
    int slots = 0;
    if (opened != Py_None)
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(opened); i++)
            slots |= !PyTuple_Check(PyList_GET_ITEM(opened, i));
    return slots ? PyObject_GetAttr(self->flight, s_written) : PyLong_FromLong(0);
}

int flight_end(Steps *self, double end, PyObject *opened) {
    if (PyList_Check(self->polled) && PyList_GET_SIZE(self->polled) > 0) {
        PyObject *r = PyObject_CallMethodNoArgs(self->flight, s_settle_polled);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    PyObject *written = written_for(self, opened);
    if (written == NULL) return -1;
    PyObject *slots = opened == Py_None ? PyTuple_New(0) : Py_NewRef(opened);
    if (slots == NULL) {
        Py_DECREF(written);
        return -1;
    }
    /* (step, took, at, reduced slots, written): what `FlightLog.step_end` queues */
    double at = clock_seconds(CLOCK_REALTIME);
    PyObject *entry = Py_BuildValue("(LddNN)", self->step, end - self->start, at, slots, written);
    if (entry == NULL) return -1;
    PyObject *r = PyObject_CallOneArg(self->ends_append, entry);
    Py_DECREF(entry);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return set_flight_progress(self, self->step, at);
}

/* A window the service thread sums (`ExpertCounts._off_thread`, decided at the first window in
   Python): its noted counts handed over. 1 when done, 0 to leave it to Python (no decision
   yet, or this rank's experts' work to take), -1 on error. */
static int hand_over(Steps *self) {
    PyObject *off = PyObject_GetAttr(self->experts, s_off_thread), *work = NULL, *noted = NULL, *handed = NULL;
    PyObject *entry = NULL, *r = NULL;
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
    /* the window's counts, taken out of the one list (`ExpertCounts._take_noted`) */
    if ((noted = PyList_GetSlice(self->noted, 0, PY_SSIZE_T_MAX)) == NULL ||
        PyList_SetSlice(self->noted, 0, PY_SSIZE_T_MAX, NULL) < 0)
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
    Py_XDECREF(entry);
    Py_XDECREF(r);
    return ok;
}

/* `ExpertCounts.step_ended(step)`: nothing on most steps; a closed window handed over to the
   service thread here (`_handed`) when nothing else is due; the rest in Python */
int experts_end(Steps *self) {
    if (self->expert_layers == 0) return 0;
    int settle = 0;
    if (self->expert_sum_due) {  /* Python may have started a window's sum: settled here */
        PyObject *flying = PyObject_GetAttr(self->experts, s_in_flight);
        if (flying == NULL) return -1;
        settle = flying != Py_None;
        Py_DECREF(flying);
        self->expert_sum_due = 0;
    }
    int closes = (self->step + 1) % self->expert_every == 0;
    if (!settle && !closes) return 0;
    if (!settle) {
        int handed = hand_over(self);
        if (handed != 0) return handed < 0 ? -1 : 0;
    }
    PyObject *r = PyObject_CallMethod(self->experts, "step_ended", "L", self->step);
    if (r == NULL) return -1;
    Py_DECREF(r);
    self->expert_sum_due = 1;  /* it may have started one */
    return 0;
}
