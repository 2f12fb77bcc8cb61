"""The CUDA C source of gdskit's BLAKE3 kernels, compiled at first use (``gdskit.engine.gpu_hash``).

Two kernels give BLAKE3's left-balanced tree over many inputs ("items") in two launches:

``blake3_blocks``
    One thread block per 256 KiB of an item: each thread compresses one 1 KiB chunk into its
    chaining value, then the block pairs adjacent nodes in shared memory for 8 levels (an odd
    last node is carried up), leaving one node per block: the root of a complete 256-chunk
    subtree, or, for an item of at most 256 chunks, the item's digest (ROOT flag applied).
``blake3_tree``
    One thread block per item of more than one block: the same pairing over its blocks' nodes,
    in place, level by level, until the root.

Pairing adjacent nodes level by level with the odd one carried up gives exactly BLAKE3's tree
(the left subtree holds the largest power of two of chunks that leaves one on the right).
The source also compiles as C++ (``BLAKE3_HOST_TEST``) so a CPU test can run its functions.
"""

#: Threads of a block, and chunks of input each block takes (one each).
BLOCK_CHUNKS = 256
#: BLAKE3's chunk.
CHUNK_BYTES = 1024

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

#define BLOCK_CHUNKS 256
#define CHUNK_START 1u
#define CHUNK_END 2u
#define PARENT 4u
#define ROOT 8u

struct Item { u64 ptr; u64 len; };

__device__ __forceinline__ u32 iv(int i) {
    const u32 v[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                      0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};
    return v[i];
}

__device__ __forceinline__ u32 rotr(u32 x, int n) { return (x >> n) | (x << (32 - n)); }

#define G(a, b, c, d, x, y) \
    s[a] = s[a] + s[b] + (x); s[d] = rotr(s[d] ^ s[a], 16); s[c] = s[c] + s[d]; s[b] = rotr(s[b] ^ s[c], 12); \
    s[a] = s[a] + s[b] + (y); s[d] = rotr(s[d] ^ s[a], 8);  s[c] = s[c] + s[d]; s[b] = rotr(s[b] ^ s[c], 7);

/* The compression function: cv (8 words) and one 64-byte block m (16 words) -> cv out. */
__device__ __forceinline__ void compress(u32 cv[8], u32 m[16], u64 counter, u32 block_len, u32 flags) {
    u32 s[16];
    #pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = cv[i];
    #pragma unroll
    for (int i = 0; i < 4; ++i) s[8 + i] = iv(i);
    s[12] = (u32)counter; s[13] = (u32)(counter >> 32); s[14] = block_len; s[15] = flags;
    #pragma unroll
    for (int r = 0; r < 7; ++r) {
        G(0, 4, 8, 12, m[0], m[1]); G(1, 5, 9, 13, m[2], m[3]);
        G(2, 6, 10, 14, m[4], m[5]); G(3, 7, 11, 15, m[6], m[7]);
        G(0, 5, 10, 15, m[8], m[9]); G(1, 6, 11, 12, m[10], m[11]);
        G(2, 7, 8, 13, m[12], m[13]); G(3, 4, 9, 14, m[14], m[15]);
        if (r < 6) {  /* the message permutation 2,6,3,10,7,0,4,13,1,11,12,5,9,14,15,8 */
            u32 t[16];
            #pragma unroll
            for (int i = 0; i < 16; ++i) t[i] = m[i];
            m[0] = t[2]; m[1] = t[6]; m[2] = t[3]; m[3] = t[10]; m[4] = t[7]; m[5] = t[0]; m[6] = t[4];
            m[7] = t[13]; m[8] = t[1]; m[9] = t[11]; m[10] = t[12]; m[11] = t[5]; m[12] = t[9];
            m[13] = t[14]; m[14] = t[15]; m[15] = t[8];
        }
    }
    #pragma unroll
    for (int i = 0; i < 8; ++i) cv[i] = s[i] ^ s[i + 8];
}

/* One 64-byte block of input, zero-padded past len (little-endian words). */
__device__ __forceinline__ void load_block(const u8* p, u32 len, u32 m[16]) {
    if (len == 64 && ((u64)p & 15) == 0) {
        const uint4* q = (const uint4*)p;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint4 v = q[i];
            m[4 * i] = v.x; m[4 * i + 1] = v.y; m[4 * i + 2] = v.z; m[4 * i + 3] = v.w;
        }
        return;
    }
    #pragma unroll
    for (int w = 0; w < 16; ++w) {
        u32 x = 0;
        for (int b = 0; b < 4; ++b) {
            u32 at = 4 * w + b;
            if (at < len) x |= ((u32)p[at]) << (8 * b);
        }
        m[w] = x;
    }
}

/* The chaining value of one chunk (len: 0..1024 bytes), counter: its index in the item. */
__device__ void chunk_cv(const u8* p, u32 len, u64 counter, u32 root, u32 cv[8]) {
    #pragma unroll
    for (int i = 0; i < 8; ++i) cv[i] = iv(i);
    u32 blocks = len == 0 ? 1 : (len + 63) / 64;
    u32 m[16];
    for (u32 b = 0; b < blocks; ++b) {
        u32 blen = len - 64 * b < 64 ? len - 64 * b : 64;
        load_block(p + 64 * b, blen, m);
        u32 flags = (b == 0 ? CHUNK_START : 0) | (b + 1 == blocks ? (CHUNK_END | root) : 0);
        compress(cv, m, counter, blen, flags);
    }
}

/* A parent node over left and right chaining values. */
__device__ __forceinline__ void parent_cv(const u32 left[8], const u32 right[8], u32 flags, u32 out[8]) {
    u32 m[16];
    #pragma unroll
    for (int i = 0; i < 8; ++i) { m[i] = left[i]; m[8 + i] = right[i]; out[i] = iv(i); }
    compress(out, m, 0, 64, PARENT | flags);
}

__device__ __forceinline__ u64 chunks_of(u64 len) { return len == 0 ? 1 : (len + 1023) / 1024; }

/* The item of global block b: the last i with block_base[i] <= b. */
__device__ int item_of(const u64* block_base, int n_items, u64 b) {
    int lo = 0, hi = n_items - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (block_base[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Phase 1 of blake3_blocks, thread t: its chunk's chaining value into the shared nodes
   (word w of node t at nodes[w * BLOCK_CHUNKS + t]). Returns the chunks of this block. */
__device__ u32 block_chunks(const Item* items, const u64* block_base, int item, u64 b, u32 t, u32* nodes) {
    Item it = items[item];
    u64 n_chunks = chunks_of(it.len);
    u64 first = (b - block_base[item]) * BLOCK_CHUNKS;
    u64 left = n_chunks - first;
    u32 k = left < BLOCK_CHUNKS ? (u32)left : BLOCK_CHUNKS;
    if (t < k) {
        u64 c = first + t;
        u64 start = c * 1024;
        u32 len = it.len - start < 1024 ? (u32)(it.len - start) : 1024;
        if (it.len == 0) len = 0;
        u32 cv[8];
        chunk_cv((const u8*)it.ptr + start, len, c, n_chunks == 1 ? ROOT : 0, cv);
        #pragma unroll
        for (int w = 0; w < 8; ++w) nodes[w * BLOCK_CHUNKS + t] = cv[w];
    }
    return k;
}

/* One level of pairing in shared memory: node t takes node t + stride. single: the item is this block. */
__device__ void block_level(u32 k, u32 level, u32 t, int single, u32* nodes) {
    u32 stride = 1u << level;
    if ((t & (2 * stride - 1)) != 0 || t + stride >= k) return;
    u32 nodes_here = (k + stride - 1) >> level;
    u32 l[8], r[8], out[8];
    #pragma unroll
    for (int w = 0; w < 8; ++w) { l[w] = nodes[w * BLOCK_CHUNKS + t]; r[w] = nodes[w * BLOCK_CHUNKS + t + stride]; }
    parent_cv(l, r, (single && nodes_here == 2) ? ROOT : 0, out);
    #pragma unroll
    for (int w = 0; w < 8; ++w) nodes[w * BLOCK_CHUNKS + t] = out[w];
}

/* One level of pairing over an item's block nodes in global memory, pair p. */
__device__ void tree_pair(u32* block_cvs, u64 base, u64 m, u64 stride, u64 p, u32* root_out) {
    u64 nodes_here = (m + stride - 1) / stride;
    u64 left = base + 2 * p * stride, right = left + stride;
    u32 l[8], r[8], out[8];
    #pragma unroll
    for (int w = 0; w < 8; ++w) { l[w] = block_cvs[8 * left + w]; r[w] = block_cvs[8 * right + w]; }
    int root = nodes_here == 2;
    parent_cv(l, r, root ? ROOT : 0, out);
    #pragma unroll
    for (int w = 0; w < 8; ++w) { block_cvs[8 * left + w] = out[w]; if (root) root_out[w] = out[w]; }
}

#ifndef BLAKE3_HOST_TEST
extern "C" __global__ void __launch_bounds__(BLOCK_CHUNKS)
blake3_blocks(const Item* items, int n_items, const u64* block_base, u32* block_cvs, u32* roots) {
    __shared__ u32 nodes[8 * BLOCK_CHUNKS];
    u64 b = blockIdx.x;
    u32 t = threadIdx.x;
    int item = item_of(block_base, n_items, b);
    u32 k = block_chunks(items, block_base, item, b, t, nodes);
    int single = block_base[item + 1] - block_base[item] == 1;
    for (u32 level = 0; level < 8; ++level) {
        __syncthreads();
        block_level(k, level, t, single, nodes);
    }
    __syncthreads();
    if (t < 8) {
        u32 w = nodes[t * BLOCK_CHUNKS];
        block_cvs[8 * b + t] = w;
        if (single) roots[8 * item + t] = w;
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_CHUNKS)
blake3_tree(int n_items, const u64* block_base, u32* block_cvs, u32* roots) {
    int item = blockIdx.x;
    u64 base = block_base[item], m = block_base[item + 1] - base;
    if (m <= 1) return;
    for (u64 stride = 1; stride < m; stride <<= 1) {
        u64 pairs = ((m + stride - 1) / stride) / 2;
        for (u64 p = threadIdx.x; p < pairs; p += blockDim.x)
            tree_pair(block_cvs, base, m, stride, p, roots + 8 * item);
        __syncthreads();
    }
}
#endif
"""
