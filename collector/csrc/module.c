/* The module: configuration, the meter, interned names, the types (see fast.h). */
#include "fast.h"

#include <fcntl.h>
#include <unistd.h>

PyObject *tensor_type, *is_grad_enabled, *queue_callback, *work_attribute;
Py_ssize_t header_size, record_size, head_size, written_offset;
int metering;
double metered_seconds, marks_seconds, probe_seconds;
long long metered_calls, marks_calls, probe_calls;
PyObject *s_requires_grad, *s_data, *s_begin, *s_polled, *s_settle_polled, *s_written, *s_step, *s_in_flight, *s_layers, *s_every, *s_map, *s_counts, *s_version, *s_seen, *s_noted, *s_record, *s_sync, *s_packed, *s_log, *s_seq, *s_lock, *s_acquire, *s_release, *s_capacity, *s_host_groups, *s_host_slots, *s_idle_work, *s_opens, *s_forward_ended, *s_off_thread, *s_work, *s_handed, *s_append, *s_meter, *s_window, *s_wait, *s_grad_fn, *s_register_prehook, *s_take;

int truthy_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* This process's resident set, as `probe.host_rss_bytes` reads it (/proc/self/statm, one
   pread on a descriptor kept open; reopened in a forked child); 0 where there is no /proc. */
long long rss_bytes(void) {
    static int fd = -1;
    static pid_t owner;
    pid_t pid = getpid();
    if (fd >= 0 && owner != pid) {  /* inherited: it reads the parent's */
        close(fd);
        fd = -1;
    }
    if (fd < 0) {
        if ((fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC)) < 0) return 0;
        owner = pid;
    }
    char buf[128];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return 0;
    buf[n] = 0;
    unsigned long long size, resident;
    if (sscanf(buf, "%llu %llu", &size, &resident) != 2) return 0;
    return (long long)resident * sysconf(_SC_PAGESIZE);
}

static PyObject *rss(PyObject *mod, PyObject *unused) { return PyLong_FromLongLong(rss_bytes()); }

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
    metered_seconds = marks_seconds = probe_seconds = 0.0;
    metered_calls = marks_calls = probe_calls = 0;
    Py_RETURN_NONE;
}

static PyObject *metered(PyObject *mod, PyObject *unused) {
    return Py_BuildValue("{s(dL)s(dL)s(dL)}", "Forward (C)", metered_seconds, metered_calls, "Backward marks (C)",
                         marks_seconds, marks_calls, METER_PROBE, probe_seconds, probe_calls);
}

static PyMethodDef module_methods[] = {
    {"meter", meter, METH_O, "meter(on): meter the forward watch's C body from now (a benchmark's account)."},
    {"metered", metered, METH_NOARGS, "{entry: (thread CPU seconds, calls)} since meter(True)."},
    {"rss", rss, METH_NOARGS, "rss(): this process's resident set in bytes, as C reads it on a step."},
    {"configure", configure, METH_VARARGS,
     "configure(torch.Tensor, torch.is_grad_enabled, queue_callback, WORK_ATTRIBUTE, HEADER_SIZE, RECORD.size, "
     "RECORD_HEAD.size, "
     "WRITTEN_OFFSET): what C checks against and writes."},
    {"append_fixed", (PyCFunction)(void (*)(void))append_fixed, METH_FASTCALL,
     "append_fixed(log, name, tail, step=None): FlightLog.append_fixed, its slot."},
    {NULL}};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT, "meshscope.collector._fast",
    "The Monitor's host steps in C (see the source's head).", -1, module_methods};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__fast(void) {
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_data, "data");
    INTERN(s_begin, "begin");
    INTERN(s_polled, "_polled");
    INTERN(s_settle_polled, "settle_polled");
    INTERN(s_written, "_written");
    INTERN(s_step, "step");
    INTERN(s_in_flight, "_in_flight");
    INTERN(s_layers, "layers");
    INTERN(s_every, "every");
    INTERN(s_map, "_map");
    INTERN(s_counts, "expert_token_counts");
    INTERN(s_version, "_version");
    INTERN(s_seen, "_seen");
    INTERN(s_noted, "_noted");
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
    INTERN(s_idle_work, "_idle_work");
    INTERN(s_opens, "_opens");
    INTERN(s_forward_ended, "forward_ended");
    INTERN(s_off_thread, "_off_thread");
    INTERN(s_append, "append");
    INTERN(s_meter, "meter");
    INTERN(s_take, "take");
    INTERN(s_window, "_window");
    INTERN(s_wait, "wait");
    INTERN(s_grad_fn, "grad_fn");
    INTERN(s_register_prehook, "register_prehook");
    INTERN(s_work, "_work");
    INTERN(s_handed, "_handed");
    if (PyType_Ready(&NoOpType) < 0 || PyType_Ready(&PhaseType) < 0 || PyType_Ready(&StepsType) < 0 ||
        PyType_Ready(&ForwardType) < 0 || PyType_Ready(&LockType) < 0)
        return NULL;
    the_noop = PyObject_CallNoArgs((PyObject *)&NoOpType);
    if (the_noop == NULL) return NULL;
    PyObject *m = PyModule_Create(&fast_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Steps", (PyObject *)&StepsType) < 0 ||
        PyModule_AddObjectRef(m, "NoOp", (PyObject *)&NoOpType) < 0 ||
        PyModule_AddObjectRef(m, "Forward", (PyObject *)&ForwardType) < 0 ||
        PyModule_AddObjectRef(m, "Phase", (PyObject *)&PhaseType) < 0 ||
        PyModule_AddObjectRef(m, "Lock", (PyObject *)&LockType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
