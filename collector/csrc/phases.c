/* A step's phases: an untimed step's no-op, a timed host step's two marks (see fast.h). */
#include "fast.h"

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

PyTypeObject NoOpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshscope.collector._fast.NoOp",
    .tp_basicsize = sizeof(NoOp),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The phase of an untimed step: a context that does nothing.",
    .tp_methods = noop_methods,
    .tp_new = PyType_GenericNew,
};

PyObject *the_noop;

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

PyTypeObject PhaseType = {
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
