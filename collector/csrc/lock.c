/* The flight log's lock: `threading.Lock` as Python uses it, which C takes without a call
   (see fast.h). Every record's sequence number is taken under it; DDP's reduction record, on
   the training thread, each forward: there the Python lock's method calls cost ~3 us cold. */
#include "fast.h"

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    int held;
} Lock;

static PyObject *lock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
        return NULL;
    }
    Lock *self = (Lock *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if ((self->lock = PyThread_allocate_lock()) == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void lock_dealloc(Lock *self) {
    if (self->lock != NULL) {
        if (self->held) PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* taken now if free; else waited for without the GIL, as threading.Lock does */
static void take(Lock *self) {
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    self->held = 1;
}

static void give(Lock *self) {
    self->held = 0;
    PyThread_release_lock(self->lock);
}

/* C's way in: the flight log's lock, ours without a call, any other lock through its methods */
int lock_take(PyObject *lock) {
    if (Py_IS_TYPE(lock, &LockType)) {
        take((Lock *)lock);
        return 0;
    }
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_acquire);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

int lock_give(PyObject *lock) {
    if (Py_IS_TYPE(lock, &LockType)) {
        if (!((Lock *)lock)->held) {
            PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
            return -1;
        }
        give((Lock *)lock);
        return 0;
    }
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *lock_acquire(Lock *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"blocking", NULL};
    int blocking = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p", kwlist, &blocking)) return NULL;
    if (!blocking) {
        if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) Py_RETURN_FALSE;
        self->held = 1;
        Py_RETURN_TRUE;
    }
    take(self);
    Py_RETURN_TRUE;
}

static PyObject *lock_release(Lock *self, PyObject *unused) {
    if (lock_give((PyObject *)self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *lock_enter(Lock *self, PyObject *unused) {
    take(self);
    Py_RETURN_TRUE;
}

static PyObject *lock_exit(Lock *self, PyObject *const *args, Py_ssize_t n) { return lock_release(self, NULL); }

static PyObject *lock_locked(Lock *self, PyObject *unused) { return PyBool_FromLong(self->held); }

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))lock_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True): take the lock (waiting without the GIL); whether it was taken."},
    {"release", (PyCFunction)lock_release, METH_NOARGS, "release(): give the lock back."},
    {"locked", (PyCFunction)lock_locked, METH_NOARGS, "locked(): whether it is held."},
    {"__enter__", (PyCFunction)lock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))lock_exit, METH_FASTCALL, NULL},
    {NULL}};

PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshscope.collector._fast.Lock",
    .tp_basicsize = sizeof(Lock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A lock as threading.Lock, which the C path takes without a call: the flight log's.",
    .tp_new = lock_new,
    .tp_dealloc = (destructor)lock_dealloc,
    .tp_methods = lock_methods,
};
