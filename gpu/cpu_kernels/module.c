/* ---------------------------------------------------------------- Python bindings */
/* METH_FASTCALL functions taking plain ints (data pointers) and floats: ~0.3 us per call,
   where ctypes spends ~5 us converting a dozen arguments. The GIL is released while a
   kernel runs. */

typedef union { void* p; i64 i; double f; } Arg;

static int parse(PyObject* const* args, Py_ssize_t nargs, const char* sig, Arg* out) {
    Py_ssize_t n = (Py_ssize_t)strlen(sig);
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* o = args[i];
        if (sig[i] == 'P') out[i].p = o == Py_None ? NULL : PyLong_AsVoidPtr(o);
        else if (sig[i] == 'I') out[i].i = PyLong_AsLongLong(o);
        else out[i].f = PyFloat_AsDouble(o);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* The Python entry of a DEFINE_LINEAR kernel (both share one argument list). */
#define DEFINE_PY_LINEAR(name)                                                                \
    static PyObject* py_##name(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {     \
        Arg a[11];                                                                            \
        if (parse(args, nargs, "PIIIPIPPPII", a) < 0) return NULL;                           \
        Py_BEGIN_ALLOW_THREADS                                                                \
        name(a[0].p, a[1].i, a[2].i, a[3].i, a[4].p, a[5].i, a[6].p, a[7].p, a[8].p, a[9].i,  \
             (int)a[10].i);                                                                   \
        Py_END_ALLOW_THREADS                                                                  \
        Py_RETURN_NONE;                                                                       \
    }

DEFINE_PY_LINEAR(f32_linear)

static PyObject* py_block_linear(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[12];
    if (parse(args, nargs, "IPIIIPIPPPII", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    block_linear((int)a[0].i, a[1].p, a[2].i, a[3].i, a[4].i, a[5].p, a[6].i, a[7].p, a[8].p,
                 a[9].p, a[10].i, (int)a[11].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* py_quantize_x(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[4];
    if (parse(args, nargs, "PIIP", a) < 0) return NULL;
    quantize_x(a[0].p, a[1].i, a[2].i, a[3].p);
    Py_RETURN_NONE;
}

/* vnni(-1): whether the VNNI path is on; vnni(0 / 1): turn it off / on where the CPU has it. */
static PyObject* py_vnni(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[1];
    if (parse(args, nargs, "I", a) < 0) return NULL;
    int on = vnni_enabled();
    if (a[0].i == 0) use_vnni = 0;
    if (a[0].i == 1) {
        use_vnni = -1;
        on = vnni_enabled();
    }
    (void)on;
    return PyLong_FromLong(use_vnni);
}

static PyObject* py_rms_norm(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[8];
    if (parse(args, nargs, "PPIIPFPI", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rms_norm(a[0].p, a[1].p, a[2].i, a[3].i, a[4].p, (float)a[5].f, a[6].p, (int)a[7].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* py_rope(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[8];
    if (parse(args, nargs, "PIIIIPPP", a) < 0) return NULL;
    rope(a[0].p, a[1].i, a[2].i, a[3].i, a[4].i, a[5].p, a[6].p, a[7].p);
    Py_RETURN_NONE;
}

static PyObject* py_qk_norm(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[9];
    if (parse(args, nargs, "PIIIIIPPF", a) < 0) return NULL;
    qk_norm(a[0].p, a[1].i, a[2].i, a[3].i, a[4].i, a[5].i, a[6].p, a[7].p, (float)a[8].f);
    Py_RETURN_NONE;
}

static PyObject* py_silu_mul(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[5];
    if (parse(args, nargs, "PIIPI", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    silu_mul(a[0].p, a[1].i, a[2].i, a[3].p, (int)a[4].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* py_paged_decode_attention(PyObject* self, PyObject* const* args,
                                           Py_ssize_t nargs) {
    Arg a[21];
    if (parse(args, nargs, "PIPPIPIPIPPPPPPIIIIFI", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    paged_decode_attention(a[0].p, a[1].i, a[2].p, a[3].p, a[4].i, a[5].p, a[6].i, a[7].p,
                           a[8].i, a[9].p, a[10].p, a[11].p, a[12].p, a[13].p, a[14].p, a[15].i,
                           a[16].i, a[17].i, a[18].i, (float)a[19].f, (int)a[20].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* py_decode_layers(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[29];
    if (parse(args, nargs, "PPIPPIIIIIIFPPPPPPPPPIFPIPPPP", a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = decode_layers(a[0].p, a[1].p, a[2].i, a[3].p, a[4].p, a[5].i, a[6].i, a[7].i, a[8].i,
                  a[9].i, a[10].i, (float)a[11].f, a[12].p, a[13].p, a[14].p, a[15].p, a[16].p,
                  a[17].p, a[18].p, a[19].p, a[20].p, a[21].i, (float)a[22].f, a[23].p,
                  (int)a[24].i, (reduce_fn)a[25].p, a[26].p, a[27].p, a[28].p);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject* py_moe_mlp(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[8];
    if (parse(args, nargs, "PPIIPPPI", a) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    moe_mlp(a[0].p, a[1].p, a[2].i, a[3].i, a[4].p, a[5].p, a[6].p, (int)a[7].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* py_shm_allreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    Arg a[3];
    if (parse(args, nargs, "PPI", a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = shm_allreduce(a[0].p, a[1].p, a[2].i);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject* py_shm_allreduce_address(PyObject* self, PyObject* const* args,
                                          Py_ssize_t nargs) {
    return PyLong_FromVoidPtr((void*)shm_allreduce);
}

static PyMethodDef methods[] = {
    {"f32_linear", (PyCFunction)(void (*)(void))py_f32_linear, METH_FASTCALL, NULL},
    {"block_linear", (PyCFunction)(void (*)(void))py_block_linear, METH_FASTCALL, NULL},
    {"quantize_x", (PyCFunction)(void (*)(void))py_quantize_x, METH_FASTCALL, NULL},
    {"vnni", (PyCFunction)(void (*)(void))py_vnni, METH_FASTCALL, NULL},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, NULL},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL, NULL},
    {"qk_norm", (PyCFunction)(void (*)(void))py_qk_norm, METH_FASTCALL, NULL},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, NULL},
    {"paged_decode_attention", (PyCFunction)(void (*)(void))py_paged_decode_attention,
     METH_FASTCALL, NULL},
    {"decode_layers", (PyCFunction)(void (*)(void))py_decode_layers, METH_FASTCALL, NULL},
    {"moe_mlp", (PyCFunction)(void (*)(void))py_moe_mlp, METH_FASTCALL, NULL},
    {"shm_allreduce", (PyCFunction)(void (*)(void))py_shm_allreduce, METH_FASTCALL, NULL},
    {"shm_allreduce_address", (PyCFunction)(void (*)(void))py_shm_allreduce_address,
     METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_meshserve_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__meshserve_cpu(void) { return PyModule_Create(&module); }
