/* The flight log's record of a collective issued again and again alike, in C (see fast.h). */
#include "fast.h"

/* --- the flight log's record of a collective issued again and again alike ---------------- */

static int put_int64(Py_buffer *view, Py_ssize_t at, int64_t v) {
    if (at < 0 || at + 8 > view->len) {
        PyErr_SetString(PyExc_IndexError, "meshscope: flight log record outside its map");
        return -1;
    }
    memcpy((char *)view->buf + at, &v, 8);  /* little-endian hosts only, as struct's "<" */
    return 0;
}

/* The next sequence number of `name` in a flight log's `seqs` (under its lock), counted on */
int take_seq(PyObject *seqs, PyObject *name, long long *seq) {
    PyObject *had = PyDict_GetItemWithError(seqs, name);
    if (had == NULL && PyErr_Occurred()) return -1;
    *seq = had == NULL ? 0 : PyLong_AsLongLong(had);
    if (*seq == -1 && PyErr_Occurred()) return -1;
    PyObject *next = PyLong_FromLongLong(*seq + 1);
    int r = next == NULL ? -1 : PyDict_SetItem(seqs, name, next);
    Py_XDECREF(next);
    return r;
}

/* Release a flight log's lock whatever happened under it: an error set stays set; -1 when the
   release itself failed (its error replaces any other) */
int release(PyObject *lock) {
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    if (lock_give(lock) < 0) {
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
        return -1;
    }
    PyErr_Restore(type, val, tb);
    return 0;
}

static int fill_record(PyObject *log, PyObject *name, PyObject *tail, PyObject *step, long long *slot_out) {
    PyObject *seqs = PyObject_GetAttr(log, s_seq), *written = NULL, *capacity = NULL, *map = NULL;
    PyObject *groups = NULL, *at_step = NULL, *value = NULL;
    Py_buffer view = {0};
    int ok = -1;
    long long seq;
    if (seqs == NULL || !PyDict_Check(seqs) || take_seq(seqs, name, &seq) < 0) goto done;
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
PyObject *append_fixed_c(PyObject *log, PyObject *name, PyObject *tail, PyObject *step) {
    PyObject *lock = PyObject_GetAttr(log, s_lock);
    if (lock == NULL) return NULL;
    if (lock_take(lock) < 0) {
        Py_DECREF(lock);
        return NULL;
    }
    long long slot = -1;
    int filled = fill_record(log, name, tail, step, &slot);
    int released = release(lock);
    Py_DECREF(lock);
    if (released < 0 || filled < 0) return NULL;
    return PyLong_FromLongLong(slot);
}

PyObject *append_fixed(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "append_fixed(log, name, tail, step=None)");
        return NULL;
    }
    return append_fixed_c(args[0], args[1], args[2], nargs == 4 ? args[3] : Py_None);
}
