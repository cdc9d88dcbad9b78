/* Chained block hashes, byte-identical to vLLM 0.33's sha256_cbor of
 * (parent, tuple(tokens), None): the hash of a block of token ids with no extra keys.
 *
 * Each block's message is the canonical CBOR of a 3-array: the parent hash as a byte
 * string, the block's token ids as an array of unsigned integers (each in its shortest
 * form), and null. It is written into one buffer and hashed with OpenSSL's SHA-256 (the
 * same library, and the same SHA instructions, as Python's hashlib). The whole chain
 * runs without the GIL.
 *
 * The digest is the low-level SHA256_Init/Update/Final, deprecated since OpenSSL 3.0 but
 * still there: the one-call SHA256() now goes through EVP and fetches the algorithm on
 * every call, 4-5 times the cost of hashing a block's 85 bytes (about 500 ns a block
 * against 110 here; EVP with the algorithm fetched once and one context reused, 150).
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_Init/Update/Final: no algorithm to fetch */
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define DIGEST_BYTES SHA256_DIGEST_LENGTH

/* A CBOR head: major type and argument, in the shortest form (RFC 8949, 4.2.1). */
static size_t put_head(unsigned char *out, unsigned major, uint64_t value)
{
    unsigned char type = (unsigned char)(major << 5);
    if (value < 24) {
        out[0] = type | (unsigned char)value;
        return 1;
    }
    if (value <= 0xff) {
        out[0] = type | 24;
        out[1] = (unsigned char)value;
        return 2;
    }
    if (value <= 0xffff) {
        out[0] = type | 25;
        out[1] = (unsigned char)(value >> 8);
        out[2] = (unsigned char)value;
        return 3;
    }
    if (value <= 0xffffffffu) {
        out[0] = type | 26;
        for (int i = 0; i < 4; i++)
            out[1 + i] = (unsigned char)(value >> (24 - 8 * i));
        return 5;
    }
    out[0] = type | 27;
    for (int i = 0; i < 8; i++)
        out[1 + i] = (unsigned char)(value >> (56 - 8 * i));
    return 9;
}

/* chain(parent, tokens, block_size) -> list[bytes]
 *
 * tokens: a buffer of native uint32 token ids (array('I')); every full block of
 * block_size of them is hashed, each chained from the previous block's hash (the first
 * from parent). */
static PyObject *chain(PyObject *self, PyObject *args)
{
    Py_buffer parent, tokens;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "y*y*n", &parent, &tokens, &block_size))
        return NULL;
    PyObject *result = NULL;
    unsigned char *digests = NULL, *message = NULL;
    if (block_size <= 0 || tokens.len % sizeof(uint32_t)) {
        PyErr_Format(PyExc_ValueError,
                     "block_size must be positive and tokens whole uint32s (block_size %zd, "
                     "%zd bytes of tokens)", block_size, tokens.len);
        goto done;
    }
    Py_ssize_t blocks = (Py_ssize_t)(tokens.len / sizeof(uint32_t)) / block_size;
    /* The longest message: 3-array head, the parent (or a digest) with its head, the
     * token array's head, every token in 5 bytes, null. */
    size_t longest_parent = (size_t)parent.len > DIGEST_BYTES ? (size_t)parent.len : DIGEST_BYTES;
    size_t capacity = 1 + 9 + longest_parent + 9 + 5 * (size_t)block_size + 1;
    digests = PyMem_RawMalloc(blocks ? (size_t)blocks * DIGEST_BYTES : 1);
    message = PyMem_RawMalloc(capacity);
    if (digests == NULL || message == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint32_t *ids = (const uint32_t *)tokens.buf;
    const unsigned char *previous = parent.buf;
    size_t previous_len = (size_t)parent.len;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        unsigned char *at = message;
        *at++ = 0x83; /* array of 3 */
        at += put_head(at, 2, previous_len); /* byte string: the parent hash */
        memcpy(at, previous, previous_len);
        at += previous_len;
        at += put_head(at, 4, (uint64_t)block_size); /* array: the block's token ids */
        const uint32_t *block = ids + b * block_size;
        for (Py_ssize_t t = 0; t < block_size; t++)
            at += put_head(at, 0, block[t]);
        *at++ = 0xf6; /* null: no extra keys */
        unsigned char *digest = digests + (size_t)b * DIGEST_BYTES;
        SHA256_CTX context;
        SHA256_Init(&context);
        SHA256_Update(&context, message, (size_t)(at - message));
        SHA256_Final(digest, &context);
        previous = digest;
        previous_len = DIGEST_BYTES;
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(blocks);
    if (result == NULL)
        goto done;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        PyObject *digest = PyBytes_FromStringAndSize(
            (const char *)digests + (size_t)b * DIGEST_BYTES, DIGEST_BYTES);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, digest);
    }
done:
    PyMem_RawFree(digests);
    PyMem_RawFree(message);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&tokens);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(parent, tokens, block_size) -> list[bytes]: the chained sha256_cbor hashes "
     "of every full block of uint32 token ids, with no extra keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline.core._blockhash",
    "Block hashes byte-identical to vLLM's sha256_cbor, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockhash(void)
{
    return PyModule_Create(&module);
}
