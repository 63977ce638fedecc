// Causal attention, prefill and decode alike: one workgroup per (query head, query token)
// walks the keys in tiles of ATTENTION_THREADS with an online softmax (running max m, running
// sum l, rescaled accumulator), so any number of keys fits in fixed workgroup memory.
// GQA/MQA: query head h reads key/value head h / (q_heads / kv_heads). Key j is visible to
// query t when k_pos[j] <= q_pos[t] and, with a sliding window, q_pos[t] - k_pos[j] < window.
// Constants: ATTENTION_THREADS (a power of two), MAX_HEAD_DIM (at most 4 * ATTENTION_THREADS).
struct Shape {
    q_heads: u32,
    kv_heads: u32,
    head_dim: u32,
    keys: u32,         // number of keys, unless follow_step
    follow_step: u32,  // 1: keys = start + n_tokens and query t is at q_pos[start + t] (KV cache)
    window: u32,       // 0: no sliding window
    scale: f32,
    pad0: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> q: array<f32>;       // [T, Hq, Dh]
@group(0) @binding(3) var<storage, read> keys: array<f32>;    // [S, Hkv, Dh]
@group(0) @binding(4) var<storage, read> values: array<f32>;  // [S, Hkv, Dh]
@group(0) @binding(5) var<storage, read> q_pos: array<i32>;
@group(0) @binding(6) var<storage, read> k_pos: array<i32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;  // [T, Hq, Dh]

const DIMS_PER_THREAD: u32 = MAX_HEAD_DIM / ATTENTION_THREADS;  // at most 4: one vec4 accumulator
var<workgroup> query: array<f32, MAX_HEAD_DIM>;
var<workgroup> probs: array<f32, ATTENTION_THREADS>;
var<workgroup> reduction: array<f32, ATTENTION_THREADS>;

// max (or sum) of every thread's value, known to all threads; the tree costs log2(threads) barriers
fn workgroup_max(lid: u32, value: f32) -> f32 {
    reduction[lid] = value;
    workgroupBarrier();
    for (var stride = ATTENTION_THREADS / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { reduction[lid] = max(reduction[lid], reduction[lid + stride]); }
        workgroupBarrier();
    }
    let result = reduction[0];
    workgroupBarrier();
    return result;
}

fn workgroup_sum(lid: u32, value: f32) -> f32 {
    reduction[lid] = value;
    workgroupBarrier();
    for (var stride = ATTENTION_THREADS / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { reduction[lid] += reduction[lid + stride]; }
        workgroupBarrier();
    }
    let result = reduction[0];
    workgroupBarrier();
    return result;
}

@compute @workgroup_size(ATTENTION_THREADS)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let dh = shape.head_dim;
    let kv_head = h / (shape.q_heads / shape.kv_heads);
    var n_keys = shape.keys;
    var q_index = t;
    if (shape.follow_step != 0u) {
        n_keys = step.start + step.n_tokens;
        q_index = step.start + t;
    }
    let query_position = q_pos[q_index];
    let q_row = (t * shape.q_heads + h) * dh;
    for (var d = lid; d < dh; d += ATTENTION_THREADS) { query[d] = q[q_row + d]; }
    workgroupBarrier();

    var m = MASKED;           // running max of the scores seen (the same in every thread)
    var l = 0.0;              // this thread's share of the running sum of exp(score - m)
    var acc = vec4<f32>(0.0); // output dims lid + c * ATTENTION_THREADS, c < DIMS_PER_THREAD
    let kv_stride = shape.kv_heads * dh;
    let value_base = kv_head * dh + lid;
    for (var tile = 0u; tile < n_keys; tile += ATTENTION_THREADS) {
        // 1. this thread's key: its score, or MASKED
        let j = tile + lid;
        var visible = false;
        var score = MASKED;
        if (j < n_keys) {
            let key_position = k_pos[j];
            visible = key_position <= query_position &&
                      (shape.window == 0u || query_position - key_position < i32(shape.window));
            if (visible) {
                let k_row = j * kv_stride + kv_head * dh;
                var s = 0.0;
                for (var d = 0u; d < dh; d++) { s += query[d] * keys[k_row + d]; }
                score = s * shape.scale;
            }
        }
        // 2. the new running max; rescale what was accumulated under the old one
        let m_new = max(m, workgroup_max(lid, score));
        let alpha = exp(m - m_new);
        let p = select(0.0, exp(score - m_new), visible);
        l = l * alpha + p;
        probs[lid] = p;
        workgroupBarrier();
        // 3. add this tile's values, weighted
        let last = min(ATTENTION_THREADS, n_keys - tile);
        var tile_acc = vec4<f32>(0.0);
        for (var i = 0u; i < last; i++) {
            let row = (tile + i) * kv_stride + value_base;
            let weight = probs[i];
            // components at constant indices: registers, where an indexed array would be memory
            tile_acc.x += weight * values[row];
            if (DIMS_PER_THREAD > 1u && lid + ATTENTION_THREADS < dh) {
                tile_acc.y += weight * values[row + ATTENTION_THREADS];
            }
            if (DIMS_PER_THREAD > 2u && lid + 2u * ATTENTION_THREADS < dh) {
                tile_acc.z += weight * values[row + 2u * ATTENTION_THREADS];
            }
            if (DIMS_PER_THREAD > 3u && lid + 3u * ATTENTION_THREADS < dh) {
                tile_acc.w += weight * values[row + 3u * ATTENTION_THREADS];
            }
        }
        acc = acc * alpha + tile_acc;
        m = m_new;
        workgroupBarrier();
    }
    let total = workgroup_sum(lid, l);
    for (var c = 0u; c < DIMS_PER_THREAD; c++) {
        let d = lid + c * ATTENTION_THREADS;
        if (d < dh) { out[q_row + d] = acc[c] / total; }
    }
}
