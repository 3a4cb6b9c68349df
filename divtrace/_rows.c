/* divtrace._rows: one 64-bit fingerprint per token row (scheme "rowlane-wsum2x32").

   A row's raw bytes (row-major, contiguous) are cut into lanes of w = 4, 2 or 1 bytes (the widest that divides
   the row's byte count), each read as a signed little-endian integer x[i]. With two sets of odd 32-bit weights
   U[i], V[i] (passed in from Python, divtrace/record/rowhash.py makes them):
       S = sum_i x[i] * U[i],  T = sum_i x[i] * V[i]   (mod 2**32),
       H = mix64(((S << 32) | T) ^ (rowbytes * 0x9E3779B97F4A7C15))
   Every weight is odd, hence a unit mod 2**32: a change in any one lane always changes both sums. 32-bit
   multiply-adds vectorize on every x86-64 (a 64-bit multiply does not before AVX-512), which made this kernel
   2-3x faster than one 64-bit sum. rowhash.py computes the same numbers with torch ops where this extension is
   not built; tests check the two agree. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* The 4-byte-lane sums, the common case (fp32 rows, and bf16/fp16 rows of even length): cloned for AVX-512,
   AVX2 and the baseline, the fastest the CPU runs picked at load (GCC target_clones); the same numbers in each. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void sums32(const unsigned char *p, Py_ssize_t n, const uint32_t *u, uint32_t *s_out, uint32_t *t_out) {
    const uint32_t *v = u + n;
    uint32_t s = 0, t = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x;
        memcpy(&x, p + 4 * i, 4);
        s += x * u[i];
        t += x * v[i];
    }
    *s_out = s;
    *t_out = t;
}

static void hash_rows(const unsigned char *base, Py_ssize_t rows, Py_ssize_t stride, Py_ssize_t rowbytes,
                      const uint32_t *u, uint64_t *out) {
    const uint64_t tag = (uint64_t)rowbytes * 0x9E3779B97F4A7C15ULL;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const unsigned char *p = base + r * stride;
        uint32_t s = 0, t = 0;
        if (rowbytes % 4 == 0) {
            sums32(p, rowbytes / 4, u, &s, &t);
        } else if (rowbytes % 2 == 0) {
            Py_ssize_t n = rowbytes / 2;
            const uint32_t *v = u + n;
            for (Py_ssize_t i = 0; i < n; i++) {
                int16_t x;
                memcpy(&x, p + 2 * i, 2);
                s += (uint32_t)(int32_t)x * u[i];
                t += (uint32_t)(int32_t)x * v[i];
            }
        } else {
            const uint32_t *v = u + rowbytes;
            for (Py_ssize_t i = 0; i < rowbytes; i++) {
                s += (uint32_t)(int32_t)(int8_t)p[i] * u[i];
                t += (uint32_t)(int32_t)(int8_t)p[i] * v[i];
            }
        }
        out[r] = mix64((((uint64_t)s << 32) | t) ^ tag);
    }
}

/* row_hashes(ptr, rows, row_stride_bytes, rowbytes, weights_ptr, out_ptr): rows at ptr + r * row_stride,
   each rowbytes long; weights: U then V, each rowbytes / lane uint32; out receives rows uint64. */
static PyObject *py_row_hashes(PyObject *self, PyObject *args) {
    unsigned long long ptr, wptr, optr;
    Py_ssize_t rows, stride, rowbytes;
    if (!PyArg_ParseTuple(args, "KnnnKK", &ptr, &rows, &stride, &rowbytes, &wptr, &optr))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    hash_rows((const unsigned char *)(uintptr_t)ptr, rows, stride, rowbytes, (const uint32_t *)(uintptr_t)wptr,
              (uint64_t *)(uintptr_t)optr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* row_hashes_bytes(ptr, rows, row_stride_bytes, rowbytes, weights_ptr): the same fingerprints returned as a bytes
   object of rows little-endian uint64 (what rows.bin holds), with no array made on the Python side: the recorder
   calls it for every value with token rows. */
static PyObject *py_row_hashes_bytes(PyObject *self, PyObject *args) {
    unsigned long long ptr, wptr;
    Py_ssize_t rows, stride, rowbytes;
    if (!PyArg_ParseTuple(args, "KnnnK", &ptr, &rows, &stride, &rowbytes, &wptr))
        return NULL;
    if (rows < 0)
        return PyErr_Format(PyExc_ValueError, "rows < 0");
    PyObject *res = PyBytes_FromStringAndSize(NULL, rows * 8);
    if (res == NULL)
        return NULL;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(res); /* (bytes data is aligned for any scalar) */
    Py_BEGIN_ALLOW_THREADS
    hash_rows((const unsigned char *)(uintptr_t)ptr, rows, stride, rowbytes, (const uint32_t *)(uintptr_t)wptr, out);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (Py_ssize_t r = 0; r < rows; r++)
        out[r] = __builtin_bswap64(out[r]);
#endif
    Py_END_ALLOW_THREADS
    return res;
}

static PyMethodDef methods[] = {
    {"row_hashes", py_row_hashes, METH_VARARGS,
     "row_hashes(ptr, rows, row_stride_bytes, rowbytes, weights_ptr, out_ptr): one uint64 per row; weights: "
     "2 x lanes uint32 (U then V)"},
    {"row_hashes_bytes", py_row_hashes_bytes, METH_VARARGS,
     "row_hashes_bytes(ptr, rows, row_stride_bytes, rowbytes, weights_ptr): the fingerprints as bytes, rows "
     "little-endian uint64"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "divtrace's per-token-row fingerprints", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
