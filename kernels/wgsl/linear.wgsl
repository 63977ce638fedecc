// y[t, n] (+)= sum_k x[t, k] * W[n, k] (+ bias[n]) for the rows n of one weight chunk.
// Matrix-vector (decode, TOKENS_PER_GROUP = 1) and matrix-matrix (prefill: each decoded weight
// unit is reused for TOKENS_PER_GROUP tokens).
//
// A workgroup owns ROWS_PER_GROUP rows and TOKENS_PER_GROUP tokens. The tokens' inputs are
// staged in workgroup memory K_TILE at a time (zero-padded past K and past the last token),
// read by every row. THREADS_PER_ROW threads split one row's inputs and their partial sums are
// added in workgroup memory. Constants: those of weights.wgsl, plus THREADS_PER_ROW (a power
// of two), ROWS_PER_GROUP, TOKENS_PER_GROUP (a power of two up to 16), HAS_BIAS, ACCUMULATE
// (add into y: the residual stream).
struct Shape {
    rows: u32,            // rows of this chunk
    k: u32,               // inputs per row (K)
    row_words: u32,       // u32 words per weight row
    groups: u32,          // scale groups per row (quantized weights)
    first_row: u32,       // the chunk's first row in the whole weight: y's first column
    x_stride: u32,        // x[t, k] = x[t * x_stride + k]
    y_offset: u32,        // y[t, n] = y[y_offset + start * y_start_stride + t * y_stride + n]
    y_stride: u32,
    y_start_stride: u32,  // non-zero when y is a KV cache written at the step's start
    last_token_only: u32, // 1: only the step's last token (the LM head during generation)
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> weight_words: array<u32>;
@group(0) @binding(4) var<storage, read> weight_scales: array<u32>;
@group(0) @binding(5) var<storage, read> weight_offsets: array<u32>;
@group(0) @binding(6) var<storage, read> bias: array<f32>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;

const WORKGROUP: u32 = THREADS_PER_ROW * ROWS_PER_GROUP;
const X_TILE_VECS: u32 = 1024u;  // 16 KiB of staged inputs
const TILE_VECS: u32 = X_TILE_VECS / TOKENS_PER_GROUP;  // per token
const K_TILE: u32 = TILE_VECS * 4u;
var<workgroup> x_tile: array<vec4<f32>, X_TILE_VECS>;  // [TOKENS_PER_GROUP][TILE_VECS]
var<workgroup> partial: array<f32, WORKGROUP * TOKENS_PER_GROUP>;

@compute @workgroup_size(WORKGROUP)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let lane = lid % THREADS_PER_ROW;
    let row = wid.x * ROWS_PER_GROUP + lid / THREADS_PER_ROW;
    let first_token = wid.y * TOKENS_PER_GROUP;
    var n_tokens = step.n_tokens;
    var token_base = 0u;
    if (shape.last_token_only != 0u) {
        token_base = step.n_tokens - 1u;
        n_tokens = 1u;
    }
    let k = shape.k;
    let units = (k + 7u) / 8u;

    var acc: array<f32, TOKENS_PER_GROUP>;
    for (var k0 = 0u; k0 < k; k0 += K_TILE) {
        for (var v = lid; v < X_TILE_VECS; v += WORKGROUP) {
            let t = first_token + v / TILE_VECS;
            let kk = k0 + (v % TILE_VECS) * 4u;
            if (kk >= units * 8u) { continue; }  // past the last unit: never read
            var value = vec4<f32>(0.0);
            if (t < n_tokens) {
                let base = (token_base + t) * shape.x_stride + kk;
                for (var c = 0u; c < 4u; c++) {
                    if (kk + c < k) { value[c] = x[base + c]; }
                }
            }
            x_tile[v] = value;
        }
        workgroupBarrier();
        if (row < shape.rows) {
            let tile_end = min(units, (k0 + K_TILE) / 8u);
            for (var u = k0 / 8u + lane; u < tile_end; u += THREADS_PER_ROW) {
                let w = weight_unit(row, u, shape.row_words, shape.groups);
                let at = (u * 8u - k0) / 4u;
                for (var i = 0u; i < TOKENS_PER_GROUP; i++) {
                    acc[i] += dot(w.lo, x_tile[i * TILE_VECS + at]) + dot(w.hi, x_tile[i * TILE_VECS + at + 1u]);
                }
            }
        }
        workgroupBarrier();
    }

    if (THREADS_PER_ROW > 1u) {
        for (var i = 0u; i < TOKENS_PER_GROUP; i++) { partial[lid * TOKENS_PER_GROUP + i] = acc[i]; }
        workgroupBarrier();
        for (var stride = THREADS_PER_ROW / 2u; stride > 0u; stride >>= 1u) {
            if (lane < stride) {
                for (var i = 0u; i < TOKENS_PER_GROUP; i++) {
                    partial[lid * TOKENS_PER_GROUP + i] += partial[(lid + stride) * TOKENS_PER_GROUP + i];
                }
            }
            workgroupBarrier();
        }
        for (var i = 0u; i < TOKENS_PER_GROUP; i++) { acc[i] = partial[lid * TOKENS_PER_GROUP + i]; }
    }

    if (lane != 0u || row >= shape.rows) { return; }
    let n = shape.first_row + row;
    for (var i = 0u; i < TOKENS_PER_GROUP; i++) {
        let t = first_token + i;
        if (t < n_tokens) {
            let index = shape.y_offset + step.start * shape.y_start_stride + t * shape.y_stride + n;
            var value = acc[i];
            if (HAS_BIAS) { value += bias[n]; }
            if (ACCUMULATE) { value += y[index]; }
            y[index] = value;
        }
    }
}
