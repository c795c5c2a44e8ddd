/* The compiled half of reactor_dist.wire.framing (optional: framing.py falls back to its
 * own pure-Python code, of identical behaviour, where this is not built or is disabled).
 *
 * Why: on the per-call path every message costs a dozen Python steps (receive it, copy
 * the MAC state, update, digest, compare, unpack the fixed header, judge it), and the
 * caller pays them once per rank.  Here a caller's whole pass over a call's
 * acknowledgements, and a rank's receipt of a plain command, are one C call each, the
 * GIL released while it waits.
 *
 * It speaks the same wire as framing.py, byte for byte: the keyed BLAKE2b-256 MAC of a
 * one-frame message (RFC 7693, with framing's key and personalization), then
 * protocol.HOT_HEAD's fixed part.  framing.py hands it every constant it uses and
 * checks HOT_FORMAT, so that a change of the layout disables this module rather than
 * letting it disagree.  Sockets are libzmq's, reached through the copy pyzmq loaded
 * (dlopen of that very file: the same library, the same socket handles).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#define HOT_FORMAT "<BBBBiQddI" /* protocol.HOT_HEAD, which the offsets below read */
#define MAC_SIZE 32
#define HOT_SIZE 36
#define ACK_SIZE (MAC_SIZE + HOT_SIZE)
#define AT_VERSION 0
#define AT_CODE 1
#define AT_FLAGS 2
#define AT_VALUE 3
#define AT_RANK 4
#define AT_SEQ 8
#define AT_COMPUTE 16
#define AT_WAIT 24
#define AT_COUNT 32

/* -- BLAKE2b (RFC 7693) -------------------------------------------------------------- */
typedef struct {
    uint64_t h[8];
    uint64_t t[2];
    uint8_t buf[128];
    size_t buflen;
} Blake2b;

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian machines only: framing.py checks sys.byteorder */
    return v;
}

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2_G(r, i, a, b, c, d)                     \
    do {                                           \
        a = a + b + m[B2_SIGMA[r][2 * i]];         \
        d = rotr64(d ^ a, 32);                     \
        c = c + d;                                 \
        b = rotr64(b ^ c, 24);                     \
        a = a + b + m[B2_SIGMA[r][2 * i + 1]];     \
        d = rotr64(d ^ a, 16);                     \
        c = c + d;                                 \
        b = rotr64(b ^ c, 63);                     \
    } while (0)

static void b2_compress(Blake2b *S, const uint8_t *block, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = S->h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= S->t[0];
    v[13] ^= S->t[1];
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        B2_G(r, 0, v[0], v[4], v[8], v[12]);
        B2_G(r, 1, v[1], v[5], v[9], v[13]);
        B2_G(r, 2, v[2], v[6], v[10], v[14]);
        B2_G(r, 3, v[3], v[7], v[11], v[15]);
        B2_G(r, 4, v[0], v[5], v[10], v[15]);
        B2_G(r, 5, v[1], v[6], v[11], v[12]);
        B2_G(r, 6, v[2], v[7], v[8], v[13]);
        B2_G(r, 7, v[3], v[4], v[9], v[14]);
    }
    for (int i = 0; i < 8; i++) S->h[i] ^= v[i] ^ v[i + 8];
}

static void b2_count(Blake2b *S, uint64_t n) {
    S->t[0] += n;
    if (S->t[0] < n) S->t[1]++;
}

static void b2_update(Blake2b *S, const uint8_t *in, size_t len) {
    if (len == 0) return;
    size_t fill = 128 - S->buflen;
    if (len > fill) {
        memcpy(S->buf + S->buflen, in, fill);
        b2_count(S, 128);
        b2_compress(S, S->buf, 0);
        S->buflen = 0;
        in += fill;
        len -= fill;
        while (len > 128) {
            b2_count(S, 128);
            b2_compress(S, in, 0);
            in += 128;
            len -= 128;
        }
    }
    memcpy(S->buf + S->buflen, in, len);
    S->buflen += len;
}

static void b2_final(Blake2b *S, uint8_t *out) {
    b2_count(S, S->buflen);
    memset(S->buf + S->buflen, 0, 128 - S->buflen);
    b2_compress(S, S->buf, 1);
    memcpy(out, S->h, MAC_SIZE); /* little-endian: the first four words */
}

/* Keyed, personalized, MAC_SIZE bytes out: hashlib.blake2b(digest_size=, key=, person=). */
static void b2_init(Blake2b *S, const uint8_t *key, size_t keylen, const uint8_t *person,
                    size_t personlen) {
    uint8_t param[64] = {0};
    param[0] = MAC_SIZE;
    param[1] = (uint8_t)keylen;
    param[2] = 1; /* fanout */
    param[3] = 1; /* depth */
    memcpy(param + 48, person, personlen);
    for (int i = 0; i < 8; i++) S->h[i] = B2_IV[i] ^ load64(param + 8 * i);
    S->t[0] = S->t[1] = 0;
    S->buflen = 0;
    uint8_t block[128] = {0};
    memcpy(block, key, keylen);
    b2_update(S, block, 128);
}

/* -- libzmq, as pyzmq loaded it ------------------------------------------------------- */
typedef struct {
    _Alignas(8) unsigned char _[64];
} zmq_msg_t;

static struct {
    int (*msg_init)(zmq_msg_t *);
    int (*msg_recv)(zmq_msg_t *, void *, int);
    int (*msg_close)(zmq_msg_t *);
    void *(*msg_data)(zmq_msg_t *);
    size_t (*msg_size)(const zmq_msg_t *);
    int (*msg_more)(const zmq_msg_t *);
    int (*errno_)(void);
} zmq;
static int zmq_bound = 0;

/* A received frame too big to copy: a read-only buffer over ZeroMQ's own message. */
typedef struct {
    PyObject_HEAD zmq_msg_t msg;
} Held;

static int held_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    Held *held = (Held *)self;
    return PyBuffer_FillInfo(view, self, zmq.msg_data(&held->msg),
                             (Py_ssize_t)zmq.msg_size(&held->msg), 1, flags);
}

static void held_dealloc(PyObject *self) {
    zmq.msg_close(&((Held *)self)->msg);
    Py_TYPE(self)->tp_free(self);
}

static PyBufferProcs held_as_buffer = {held_getbuffer, NULL};

static PyTypeObject HeldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reactor_dist.wire._framing.Held",
    .tp_basicsize = sizeof(Held),
    .tp_dealloc = held_dealloc,
    .tp_as_buffer = &held_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A received frame over the copy limit: a read-only buffer over ZeroMQ's message.",
};

/* -- Wire: one secret's MAC and the constants framing.py hands over ---------------- */
/* framing.compiled_wire names each of these, by the names below. */
enum { VERSION, CALL_CODE, REPLY_CODE, ITEM_CODE, OK, TAKEN_FLAGS, EMBEDDED, BEHIND, COUNT,
       COMPUTE, WAIT, COPY_LIMIT, MAX_MESSAGE, N_INTS };
static const char *INT_NAMES[N_INTS] = {
    "version", "call_code", "reply_code", "item_code", "ok", "taken_flags", "embedded",
    "behind", "count", "compute", "wait", "copy_limit", "max_message"};
enum { FAILED, TOO_BIG, METHODS, METHOD_CODES, K_KIND, K_SEQ, K_RANK, K_METHOD, K_BEHIND,
       K_INDEX, K_STATUS, K_COMPUTE, K_WAIT, V_CALL, V_ITEM, V_REPLY, V_OK, N_OBJECTS };
static const char *OBJECT_NAMES[N_OBJECTS] = {
    "failed",   /* failed(errno): raises the pyzmq error of errno */
    "too_big",  /* too_big(size): raises framing's ProtocolError for MAX_MESSAGE */
    "methods",  /* {code: name} of the built-in methods */
    "method_codes", /* {name: code} */
    "k_kind", "k_seq", "k_rank", "k_method", "k_behind", "k_index", "k_status", "k_compute",
    "k_wait", "v_call", "v_item", "v_reply", "v_ok"};

typedef struct {
    PyObject_HEAD Blake2b one_frame; /* keyed with the secret, personalized MAC_ONE_FRAME */
    long n[N_INTS];
    PyObject *o[N_OBJECTS];
} Wire;

static void wire_dealloc(PyObject *self) {
    Wire *w = (Wire *)self;
    for (int i = 0; i < N_OBJECTS; i++) Py_CLEAR(w->o[i]);
    Py_TYPE(self)->tp_free(self);
}

/* Wire(key, person, ints, objects): ints and objects are dicts of the names above. */
static int wire_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    Wire *w = (Wire *)self;
    Py_buffer key, person;
    PyObject *ints, *objects;
    static char *names[] = {"key", "person", "ints", "objects", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*O!O!", names, &key, &person,
                                     &PyDict_Type, &ints, &PyDict_Type, &objects))
        return -1;
    int bad = key.len > 64 || person.len > 16;
    if (bad)
        PyErr_SetString(PyExc_ValueError, "a BLAKE2b key holds at most 64 bytes, a "
                                          "personalization at most 16");
    else
        b2_init(&w->one_frame, key.buf, (size_t)key.len, person.buf, (size_t)person.len);
    PyBuffer_Release(&key);
    PyBuffer_Release(&person);
    if (bad) return -1;
    for (int i = 0; i < N_INTS; i++) {
        PyObject *value = PyDict_GetItemString(ints, INT_NAMES[i]);
        if (value == NULL) {
            PyErr_Format(PyExc_KeyError, "Wire() needs the int %s", INT_NAMES[i]);
            return -1;
        }
        w->n[i] = PyLong_AsLong(value);
        if (w->n[i] == -1 && PyErr_Occurred()) return -1;
    }
    for (int i = 0; i < N_OBJECTS; i++) {
        PyObject *value = PyDict_GetItemString(objects, OBJECT_NAMES[i]);
        if (value == NULL) {
            PyErr_Format(PyExc_KeyError, "Wire() needs the object %s", OBJECT_NAMES[i]);
            return -1;
        }
        Py_INCREF(value);
        Py_XSETREF(w->o[i], value);
    }
    if (!PyDict_Check(w->o[METHODS]) || !PyDict_Check(w->o[METHOD_CODES])) {
        PyErr_SetString(PyExc_TypeError, "Wire(): methods and method_codes are dicts");
        return -1;
    }
    return 0;
}

static void one_frame_mac(const Wire *w, const uint8_t *data, size_t len, uint8_t *out) {
    Blake2b S = w->one_frame;
    b2_update(&S, data, len);
    b2_final(&S, out);
}

/* Constant time, as hmac.compare_digest. */
static int same_mac(const uint8_t *a, const uint8_t *b) {
    uint8_t diff = 0;
    for (int i = 0; i < MAC_SIZE; i++) diff |= a[i] ^ b[i];
    return diff == 0;
}

static PyObject *wire_mac(PyObject *self, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) return NULL;
    uint8_t out[MAC_SIZE];
    one_frame_mac((Wire *)self, data.buf, (size_t)data.len, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, MAC_SIZE);
}

/* sign(head): the one frame of a message whose header is ``head``: its MAC, then it. */
static PyObject *wire_sign(PyObject *self, PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "sign() takes the header's bytes");
        return NULL;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(arg);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, MAC_SIZE + len);
    if (frame == NULL) return NULL;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(frame);
    memcpy(out + MAC_SIZE, PyBytes_AS_STRING(arg), (size_t)len);
    one_frame_mac((Wire *)self, out + MAC_SIZE, (size_t)len, out);
    return frame;
}

/* header.get(key) (borrowed; NULL when absent, without an error). */
static PyObject *field(PyObject *header, PyObject *key) {
    return PyDict_GetItemWithError(header, key);
}

/* An exact int in [low, high) into *out; 0 for anything else (then framing's own path
 * packs it, or raises as it would). */
static int int_in(PyObject *value, long long low, long long high, long long *out) {
    if (value == NULL || !PyLong_CheckExact(value)) return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    if (v < low || v >= high) return 0;
    *out = v;
    return 1;
}

static int same(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (a == NULL || b == NULL) return 0;
    int equal = PyObject_RichCompareBool(a, b, Py_EQ);
    if (equal < 0) PyErr_Clear();
    return equal > 0;
}

/* pack_plain(header, embedded): the signed one frame of framing._plain_head's messages (a
 * plain CALL, a plain REPLY of status OK, an ITEM with only its index), byte for byte
 * what Channel.pack makes of them; None for any other header (Channel.pack's own path). */
static PyObject *wire_pack_plain(PyObject *self, PyObject *args) {
    Wire *w = (Wire *)self;
    PyObject *header, *embedded;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &header, &embedded)) return NULL;
    if (embedded != Py_None && !PyBytes_Check(embedded)) Py_RETURN_NONE;
    Py_ssize_t n = PyDict_GET_SIZE(header);
    PyObject *kind = field(header, w->o[K_KIND]);
    long long rank, seq, count = 0;
    int flags = embedded == Py_None ? 0 : (int)w->n[EMBEDDED], code, value;
    double compute = 0.0, wait = 0.0;
    if (!int_in(field(header, w->o[K_RANK]), INT32_MIN, (long long)INT32_MAX + 1, &rank) ||
        !int_in(field(header, w->o[K_SEQ]), 0, INT64_MAX, &seq))
        goto other; /* (a seq of 2**63 or more: the general path packs it) */
    if (same(kind, w->o[V_CALL])) {
        if (n == 5 && field(header, w->o[K_BEHIND]) == Py_True)
            flags |= (int)w->n[BEHIND];
        else if (n != 4)
            goto other;
        PyObject *method = field(header, w->o[K_METHOD]);
        if (method == NULL || !PyUnicode_CheckExact(method)) goto other;
        PyObject *known = PyDict_GetItemWithError(w->o[METHOD_CODES], method);
        long long number;
        if (!int_in(known, 1, 256, &number)) goto other;
        code = (int)w->n[CALL_CODE];
        value = (int)number;
    } else if (same(kind, w->o[V_REPLY])) {
        if (n < 5 || n > 6 || !same(field(header, w->o[K_STATUS]), w->o[V_OK])) goto other;
        PyObject *took = field(header, w->o[K_COMPUTE]), *waited = field(header, w->o[K_WAIT]);
        if (took == NULL || !PyFloat_CheckExact(took) ||
            (waited != NULL && !PyFloat_CheckExact(waited)) || n != 5 + (waited != NULL))
            goto other;
        compute = PyFloat_AS_DOUBLE(took);
        if (waited != NULL) {
            wait = PyFloat_AS_DOUBLE(waited);
            flags |= (int)w->n[WAIT];
        }
        flags |= (int)w->n[COMPUTE];
        code = (int)w->n[REPLY_CODE];
        value = (int)w->n[OK];
    } else if (same(kind, w->o[V_ITEM])) {
        if (n != 4 || !int_in(field(header, w->o[K_INDEX]), 0, 1LL << 32, &count)) goto other;
        flags |= (int)w->n[COUNT];
        code = (int)w->n[ITEM_CODE];
        value = 0;
    } else {
        goto other;
    }
    Py_ssize_t tail = embedded == Py_None ? 0 : PyBytes_GET_SIZE(embedded);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, ACK_SIZE + tail);
    if (frame == NULL) return NULL;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(frame), *head = out + MAC_SIZE;
    int32_t rank32 = (int32_t)rank;
    uint64_t seq64 = (uint64_t)seq;
    uint32_t count32 = (uint32_t)count;
    head[AT_VERSION] = (uint8_t)w->n[VERSION];
    head[AT_CODE] = (uint8_t)code;
    head[AT_FLAGS] = (uint8_t)flags;
    head[AT_VALUE] = (uint8_t)value;
    memcpy(head + AT_RANK, &rank32, 4);
    memcpy(head + AT_SEQ, &seq64, 8);
    memcpy(head + AT_COMPUTE, &compute, 8);
    memcpy(head + AT_WAIT, &wait, 8);
    memcpy(head + AT_COUNT, &count32, 4);
    if (tail) memcpy(head + HOT_SIZE, PyBytes_AS_STRING(embedded), (size_t)tail);
    one_frame_mac(w, head, HOT_SIZE + (size_t)tail, out);
    return frame;
other:
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *zmq_failed(Wire *w, int err) {
    PyObject *done = PyObject_CallFunction(w->o[FAILED], "i", err);
    Py_XDECREF(done);
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "libzmq failed (errno %d)", err);
    return NULL;
}

/* One frame into ``msg`` (initialized here): 0, or -1 with errno's value in *err, or -2
 * with a signal handler's exception set (EINTR is retried once the handlers ran without
 * raising); on failure ``msg`` is closed again. */
static int recv_frame(void *sock, zmq_msg_t *msg, int flags, int *err) {
    zmq.msg_init(msg);
    for (;;) {
        int rc;
        Py_BEGIN_ALLOW_THREADS rc = zmq.msg_recv(msg, sock, flags);
        Py_END_ALLOW_THREADS if (rc >= 0) return 0;
        *err = zmq.errno_();
        if (*err != EINTR || PyErr_CheckSignals() < 0) {
            zmq.msg_close(msg);
            return *err == EINTR ? -2 : -1; /* -2: a handler raised (Ctrl-C) */
        }
    }
}

/* A frame as framing.receive keeps it: bytes up to the copy limit, else a memoryview of
 * ZeroMQ's own buffer (never copied), as pyzmq's Frame.buffer is. */
static PyObject *frame_object(Wire *w, zmq_msg_t *msg) {
    size_t size = zmq.msg_size(msg);
    if ((Py_ssize_t)size <= w->n[COPY_LIMIT]) {
        PyObject *bytes = PyBytes_FromStringAndSize(zmq.msg_data(msg), (Py_ssize_t)size);
        zmq.msg_close(msg);
        return bytes;
    }
    Held *held = PyObject_New(Held, &HeldType);
    if (held == NULL) {
        zmq.msg_close(msg);
        return NULL;
    }
    memcpy(&held->msg, msg, sizeof(zmq_msg_t)); /* the message moves into the object */
    PyObject *view = PyMemoryView_FromObject((PyObject *)held);
    Py_DECREF(held);
    return view;
}

/* The rest of a message whose first frame (moved in as ``first``) has more: the frames
 * list, as framing.receive gives it. */
static PyObject *rest_of(Wire *w, void *sock, PyObject *parts, Py_ssize_t size) {
    int more = 1, err;
    while (more) {
        zmq_msg_t msg;
        int rc = recv_frame(sock, &msg, 0, &err);
        if (rc < 0) {
            Py_XDECREF(parts);
            return rc == -2 ? NULL : zmq_failed(w, err);
        }
        more = zmq.msg_more(&msg);
        size += (Py_ssize_t)zmq.msg_size(&msg);
        if (size > w->n[MAX_MESSAGE]) {
            Py_CLEAR(parts); /* keep reading to its end, holding nothing */
        }
        if (parts == NULL) {
            zmq.msg_close(&msg);
            continue;
        }
        PyObject *frame = frame_object(w, &msg);
        if (frame == NULL || PyList_Append(parts, frame) < 0) {
            Py_XDECREF(frame);
            Py_DECREF(parts);
            return NULL;
        }
        Py_DECREF(frame);
    }
    if (parts == NULL) {
        PyObject *done = PyObject_CallFunction(w->o[TOO_BIG], "n", size);
        Py_XDECREF(done);
        return NULL;
    }
    return parts;
}

/* One whole message whose first frame is in ``msg``: the list of its frames. */
static PyObject *whole(Wire *w, void *sock, zmq_msg_t *msg) {
    int more = zmq.msg_more(msg);
    Py_ssize_t size = (Py_ssize_t)zmq.msg_size(msg);
    PyObject *first = frame_object(w, msg);
    if (first == NULL) return NULL;
    PyObject *parts = PyList_New(1);
    if (parts == NULL) {
        Py_DECREF(first);
        return NULL;
    }
    PyList_SET_ITEM(parts, 0, first);
    return more ? rest_of(w, sock, parts, size) : parts;
}

/* A socket's handle (pyzmq's Socket.underlying); 0, a closed socket's, fails with
 * ENOTSOCK as pyzmq's own calls on a closed socket do. */
static void *socket_of(Wire *w, PyObject *handle) {
    void *sock = PyLong_AsVoidPtr(handle);
    if (sock == NULL && !PyErr_Occurred()) zmq_failed(w, ENOTSOCK);
    return sock;
}

static int check_bound(void) {
    if (!zmq_bound) PyErr_SetString(PyExc_RuntimeError, "bind() libzmq first");
    return zmq_bound;
}

/* The first frame, into ``msg``, of the message that a (handle, flags) method receives:
 * the frame's socket, or NULL with an error set. */
static void *first_frame(Wire *w, PyObject *args, zmq_msg_t *msg) {
    PyObject *handle;
    int flags, err;
    if (!PyArg_ParseTuple(args, "Oi", &handle, &flags) || !check_bound()) return NULL;
    void *sock = socket_of(w, handle);
    if (sock == NULL) return NULL;
    int rc = recv_frame(sock, msg, flags, &err);
    if (rc == -1) zmq_failed(w, err);
    return rc < 0 ? NULL : sock;
}

/* receive(handle, flags): one whole message's frames, as framing.receive gives them. */
static PyObject *wire_receive(PyObject *self, PyObject *args) {
    zmq_msg_t msg;
    void *sock = first_frame((Wire *)self, args, &msg);
    return sock == NULL ? NULL : whole((Wire *)self, sock, &msg);
}

/* The fixed part's fields of an authentic one-frame REPLY that framing.Channel.take hands
 * over undecoded (HOT_HEAD's nine fields and the payload, None for an acknowledgement);
 * NULL without an error for any other message. */
static PyObject *taken(const Wire *w, const uint8_t *data, size_t size) {
    if (size < ACK_SIZE || data[MAC_SIZE + AT_CODE] != w->n[REPLY_CODE]) return NULL;
    uint8_t mac[MAC_SIZE];
    one_frame_mac(w, data + MAC_SIZE, size - MAC_SIZE, mac);
    if (!same_mac(mac, data)) return NULL;
    const uint8_t *head = data + MAC_SIZE;
    int flags = head[AT_FLAGS];
    if (head[AT_VERSION] != w->n[VERSION] || head[AT_VALUE] != w->n[OK] || (flags & ~w->n[TAKEN_FLAGS]))
        return NULL;
    PyObject *payload;
    if (!(flags & w->n[EMBEDDED])) {
        if (size != ACK_SIZE) return NULL;
        payload = Py_None;
        Py_INCREF(payload);
    } else {
        if (size <= ACK_SIZE) return NULL;
        payload = PyBytes_FromStringAndSize((const char *)data + ACK_SIZE,
                                            (Py_ssize_t)(size - ACK_SIZE));
        if (payload == NULL) return NULL;
    }
    int32_t rank;
    uint64_t seq;
    double compute, wait;
    uint32_t count;
    memcpy(&rank, head + AT_RANK, 4);
    memcpy(&seq, head + AT_SEQ, 8);
    memcpy(&compute, head + AT_COMPUTE, 8);
    memcpy(&wait, head + AT_WAIT, 8);
    memcpy(&count, head + AT_COUNT, 4);
    return Py_BuildValue("(iiiiiKddIN)", head[AT_VERSION], head[AT_CODE], flags, head[AT_VALUE],
                         (int)rank, (unsigned long long)seq, compute, wait, (unsigned int)count,
                         payload);
}

/* An authentic one-frame CALL or ITEM of framing's plain form (framing._plain_message),
 * decoded: ``(header, body)`` as Channel.unpack gives it; NULL without an error for any
 * other message (Channel.unpack's to judge). */
static PyObject *plain(const Wire *w, const uint8_t *data, size_t size) {
    const uint8_t *head = data + MAC_SIZE;
    if (size < ACK_SIZE || (Py_ssize_t)size > w->n[COPY_LIMIT] || head[AT_VERSION] != w->n[VERSION] ||
        (head[AT_CODE] != w->n[CALL_CODE] && head[AT_CODE] != w->n[ITEM_CODE]))
        return NULL;
    uint8_t mac[MAC_SIZE];
    one_frame_mac(w, head, size - MAC_SIZE, mac);
    if (!same_mac(mac, data)) return NULL;
    int hot_flags = head[AT_FLAGS], value = head[AT_VALUE], call = head[AT_CODE] == w->n[CALL_CODE];
    if (!(hot_flags & w->n[EMBEDDED]) && size != ACK_SIZE) return NULL;
    PyObject *kind, *field, *named;
    if (call) {
        if (hot_flags & ~(w->n[EMBEDDED] | w->n[BEHIND])) return NULL;
        PyObject *code = PyLong_FromLong(value);
        if (code == NULL) return NULL;
        named = PyDict_GetItemWithError(w->o[METHODS], code); /* borrowed */
        Py_DECREF(code);
        if (named == NULL) return NULL;
        Py_INCREF(named);
        kind = w->o[V_CALL];
        field = w->o[K_METHOD];
    } else {
        if (value || (hot_flags & ~w->n[EMBEDDED]) != w->n[COUNT]) return NULL;
        uint32_t count;
        memcpy(&count, head + AT_COUNT, 4);
        named = PyLong_FromUnsignedLong(count);
        if (named == NULL) return NULL;
        kind = w->o[V_ITEM];
        field = w->o[K_INDEX];
    }
    int32_t rank;
    uint64_t seq;
    memcpy(&rank, head + AT_RANK, 4);
    memcpy(&seq, head + AT_SEQ, 8);
    PyObject *body = PyList_New(0);
    PyObject *header = PyDict_New();
    PyObject *seq_obj = PyLong_FromUnsignedLongLong(seq), *rank_obj = PyLong_FromLong(rank);
    int bad = body == NULL || header == NULL || seq_obj == NULL || rank_obj == NULL ||
              PyDict_SetItem(header, w->o[K_KIND], kind) < 0 ||
              PyDict_SetItem(header, w->o[K_SEQ], seq_obj) < 0 ||
              PyDict_SetItem(header, w->o[K_RANK], rank_obj) < 0 ||
              PyDict_SetItem(header, field, named) < 0 ||
              (call && (hot_flags & w->n[BEHIND]) && PyDict_SetItem(header, w->o[K_BEHIND], Py_True) < 0);
    Py_XDECREF(seq_obj);
    Py_XDECREF(rank_obj);
    Py_DECREF(named);
    if (!bad && (hot_flags & w->n[EMBEDDED])) {
        PyObject *embedded = PyBytes_FromStringAndSize((const char *)data + ACK_SIZE,
                                                       (Py_ssize_t)(size - ACK_SIZE));
        bad = embedded == NULL || PyList_Append(body, embedded) < 0;
        Py_XDECREF(embedded);
    }
    if (bad) {
        Py_XDECREF(body);
        Py_XDECREF(header);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return NULL;
    }
    return Py_BuildValue("(NN)", header, body);
}

static double monotonic(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* gather(handle, seq, owed, world_size, flags, wait_ms, until) -> (arrived, rest, retime)
 *
 * Bus.gather's pass: authentic plain replies (framing.Channel.take's tuples) in the order
 * they arrived, as long as each is one of call ``seq``, of a rank below world_size, and
 * fewer than ``owed`` came.  ``rest``: the message that ended the pass, else None: a plain
 * CALL or ITEM decoded (plain(): a stream's item), or any other the list of its frames,
 * unjudged (what take would decode whole).  A message
 * that take does hand over but of a rank out of range is dropped and ends the pass, as
 * Bus.receive's None does.  ``retime``: the pass stopped because ``until`` (monotonic
 * seconds; negative: none) is nearer than ``wait_ms``, for the caller to set the socket's
 * timeout anew and go on.  Every receive uses ``flags`` (ZMQ_DONTWAIT, or 0: RCVTIMEO). */
static PyObject *wire_gather(PyObject *self, PyObject *args) {
    Wire *w = (Wire *)self;
    PyObject *handle;
    unsigned long long seq;
    Py_ssize_t owed;
    int world_size, flags, wait_ms, err, retime = 0;
    double until;
    if (!PyArg_ParseTuple(args, "OKniiid", &handle, &seq, &owed, &world_size, &flags, &wait_ms,
                          &until) ||
        !check_bound())
        return NULL;
    void *sock = socket_of((Wire *)self, handle);
    if (sock == NULL) return NULL;
    PyObject *arrived = PyList_New(0), *rest = NULL;
    if (arrived == NULL) return NULL;
    for (;;) {
        zmq_msg_t msg;
        int rc = recv_frame(sock, &msg, flags, &err);
        if (rc < 0) {
            if (rc == -1 && err == EAGAIN) break;
            Py_DECREF(arrived);
            return rc == -2 ? NULL : zmq_failed(w, err);
        }
        PyObject *fields = NULL;
        if (!zmq.msg_more(&msg)) {
            fields = taken(w, zmq.msg_data(&msg), zmq.msg_size(&msg));
            if (fields == NULL && !PyErr_Occurred())  /* a stream's item, say */
                rest = plain(w, zmq.msg_data(&msg), zmq.msg_size(&msg));
        }
        if (fields == NULL) {
            if (PyErr_Occurred()) {
                zmq.msg_close(&msg);
                Py_DECREF(arrived);
                return NULL;
            }
            if (rest != NULL) {
                zmq.msg_close(&msg);
                break;
            }
            rest = whole(w, sock, &msg);
            if (rest == NULL) {
                Py_DECREF(arrived);
                return NULL;
            }
            break;
        }
        zmq.msg_close(&msg);
        long rank = PyLong_AsLong(PyTuple_GET_ITEM(fields, AT_RANK));
        if (rank < 0 || rank >= world_size) {
            Py_DECREF(fields);
            break;
        }
        int same = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(fields, 5)) == seq;
        if (PyList_Append(arrived, fields) < 0) {
            Py_DECREF(fields);
            Py_DECREF(arrived);
            return NULL;
        }
        Py_DECREF(fields);
        if (!same || --owed <= 0) break;
        if (until >= 0 && (until - monotonic()) * 1000.0 < wait_ms) {
            retime = 1;
            break;
        }
    }
    if (rest == NULL) {
        rest = Py_None;
        Py_INCREF(rest);
    }
    return Py_BuildValue("(NNi)", arrived, rest, retime);
}

/* command(handle, flags): a rank's next message: a plain CALL or ITEM decoded (plain()),
 * any other message as its list of frames, unjudged (Channel.unpack's to verify). */
static PyObject *wire_command(PyObject *self, PyObject *args) {
    Wire *w = (Wire *)self;
    zmq_msg_t msg;
    void *sock = first_frame(w, args, &msg);
    if (sock == NULL) return NULL;
    PyObject *decoded = zmq.msg_more(&msg) ? NULL : plain(w, zmq.msg_data(&msg), zmq.msg_size(&msg));
    if (decoded != NULL || PyErr_Occurred()) {
        zmq.msg_close(&msg);
        return decoded;
    }
    return whole(w, sock, &msg);
}

static PyMethodDef wire_methods[] = {
    {"mac", wire_mac, METH_O, "The one-frame MAC of ``data``."},
    {"sign", wire_sign, METH_O, "A one-frame message's frame: the MAC of ``head``, then it."},
    {"pack_plain", wire_pack_plain, METH_VARARGS, "A plain message's signed frame, or None."},
    {"receive", wire_receive, METH_VARARGS, "One whole message's frames, unjudged."},
    {"gather", wire_gather, METH_VARARGS, "A pass over one call's plain replies."},
    {"command", wire_command, METH_VARARGS, "A rank's next message, a plain one decoded."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject WireType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reactor_dist.wire._framing.Wire",
    .tp_basicsize = sizeof(Wire),
    .tp_dealloc = wire_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One secret's MAC and framing's constants: the compiled per-message path.",
    .tp_methods = wire_methods,
    .tp_init = wire_init,
    .tp_new = PyType_GenericNew,
};

/* bind(path): reach libzmq through the file pyzmq already loaded (RTLD_NOLOAD: never a
 * second copy, whose sockets would not be pyzmq's). */
static PyObject *module_bind(PyObject *module, PyObject *arg) {
    (void)module;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_OSError, "libzmq at %s is not loaded: %s", path, dlerror());
        return NULL;
    }
    struct {
        const char *name;
        void **slot;
    } wanted[] = {{"zmq_msg_init", (void **)&zmq.msg_init},
                  {"zmq_msg_recv", (void **)&zmq.msg_recv},
                  {"zmq_msg_close", (void **)&zmq.msg_close},
                  {"zmq_msg_data", (void **)&zmq.msg_data},
                  {"zmq_msg_size", (void **)&zmq.msg_size},
                  {"zmq_msg_more", (void **)&zmq.msg_more},
                  {"zmq_errno", (void **)&zmq.errno_}};
    for (size_t i = 0; i < sizeof(wanted) / sizeof(wanted[0]); i++) {
        void *symbol = dlsym(lib, wanted[i].name);
        if (symbol == NULL) {
            PyErr_Format(PyExc_OSError, "libzmq at %s has no %s", path, wanted[i].name);
            return NULL;
        }
        *wanted[i].slot = symbol;
    }
    zmq_bound = 1; /* the handle stays open: pyzmq holds the library for the process */
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", module_bind, METH_O, "Reach libzmq through the file pyzmq loaded."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef framing_module = {
    PyModuleDef_HEAD_INIT, "reactor_dist.wire._framing",
    "The compiled half of reactor_dist.wire.framing.", -1, module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__framing(void) {
    if (PyType_Ready(&HeldType) < 0 || PyType_Ready(&WireType) < 0) return NULL;
    PyObject *module = PyModule_Create(&framing_module);
    if (module == NULL) return NULL;
    Py_INCREF(&WireType);
    if (PyModule_AddObject(module, "Wire", (PyObject *)&WireType) < 0 ||
        PyModule_AddStringConstant(module, "HOT_FORMAT", HOT_FORMAT) < 0 ||
        PyModule_AddIntConstant(module, "MAC_SIZE", MAC_SIZE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
