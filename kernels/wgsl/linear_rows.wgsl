// y[t, n] (+)= sum_k x[t, k] * W[n, k] (+ bias[n]): the CPU-device variant of linear.wgsl.
//
// On a Vulkan device that runs on the CPU (lavapipe) a workgroup is a loop over SIMD lanes,
// one invocation per lane. Every load an invocation makes from a storage buffer or from
// workgroup memory becomes a gather, but a load from a uniform buffer at an address that is the
// same for all invocations is one scalar load, broadcast. So here each invocation owns a whole
// row (no reduction, no barrier) and the inputs come through a uniform binding: the host binds
// the window of TOKENS_PER_GROUP input rows with a dynamic offset (one dispatch per window) and
// `first_token`, also at a dynamic offset, says which token the window starts at.
// Scales and offsets are applied once per group: sum_k (s q_k + o) x_k = s sum q_k x_k + o sum x_k.
//
// Constants: those of weights.wgsl, TOKENS_PER_GROUP (1, 2, 4 or 8), X_VECS (vec4s in the window), HAS_BIAS,
// ACCUMULATE. The host guarantees K % 8 == 0 and TOKENS_PER_GROUP * K <= 4 * X_VECS.
struct Shape {
    rows: u32,
    k: u32,
    row_words: u32,
    groups: u32,
    first_row: u32,
    y_offset: u32,        // y[t, n] = y[y_offset + start * y_start_stride + t * y_stride + n]
    y_stride: u32,
    y_start_stride: u32,
    last_token_only: u32, // 1: the window is the step's last token, written as y's row 0
}
struct FirstToken {
    index: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<uniform> x: array<vec4<f32>, X_VECS>;  // [TOKENS_PER_GROUP][K / 4]
@group(0) @binding(3) var<uniform> first_token: FirstToken;
@group(0) @binding(4) var<storage, read> weight_words: array<u32>;
@group(0) @binding(5) var<storage, read> weight_scales: array<u32>;
@group(0) @binding(6) var<storage, read> weight_offsets: array<u32>;
@group(0) @binding(7) var<storage, read> bias: array<f32>;
@group(0) @binding(8) var<storage, read_write> y: array<f32>;

// the unit's codes as they enter the dot product: minus the zero point when symmetric, so that
// the group's scale multiplies the sum; plain values for float weights
fn unit_codes(row: u32, u: u32) -> Unit {
    if (WEIGHT_KIND == 0u) {
        let w = weight_words[row * shape.row_words + u];
        let lo = vec4<f32>(vec4<u32>(w, w >> 4u, w >> 8u, w >> 12u) & vec4<u32>(15u));
        let hi = vec4<f32>(vec4<u32>(w >> 16u, w >> 20u, w >> 24u, w >> 28u) & vec4<u32>(15u));
        if (SYMMETRIC) { return Unit(lo - 8.0, hi - 8.0); }
        return Unit(lo, hi);
    }
    if (WEIGHT_KIND == 1u) {
        let a = weight_words[row * shape.row_words + 2u * u];
        let b = weight_words[row * shape.row_words + 2u * u + 1u];
        let lo = vec4<f32>(vec4<u32>(a, a >> 8u, a >> 16u, a >> 24u) & vec4<u32>(255u));
        let hi = vec4<f32>(vec4<u32>(b, b >> 8u, b >> 16u, b >> 24u) & vec4<u32>(255u));
        if (SYMMETRIC) { return Unit(lo - 128.0, hi - 128.0); }
        return Unit(lo, hi);
    }
    return weight_unit(row, u, shape.row_words, shape.groups);
}

const QUANTIZED: bool = WEIGHT_KIND < 2u;
const UNITS_PER_GROUP: u32 = GROUP_SIZE / 8u;

// Per-token sums live in two vec4s (tokens 0-3 and 4-7), touched only at constant components:
// lavapipe keeps them in registers, where a dynamically indexed array would go to memory.
fn token_dot(w: Unit, t: u32, u: u32, x_vecs: u32) -> f32 {
    let base = t * x_vecs + 2u * u;
    return dot(w.lo, x[base]) + dot(w.hi, x[base + 1u]);
}

fn token_sum(t: u32, u: u32, x_vecs: u32) -> f32 {
    let base = t * x_vecs + 2u * u;
    return dot(x[base] + x[base + 1u], vec4<f32>(1.0));
}

fn window_dots(w: Unit, u: u32, x_vecs: u32, first: vec4<f32>, second: vec4<f32>) -> array<vec4<f32>, 2> {
    var a = first;
    var b = second;
    a.x += token_dot(w, 0u, u, x_vecs);
    if (TOKENS_PER_GROUP > 1u) { a.y += token_dot(w, 1u, u, x_vecs); }
    if (TOKENS_PER_GROUP > 2u) {
        a.z += token_dot(w, 2u, u, x_vecs);
        a.w += token_dot(w, 3u, u, x_vecs);
    }
    if (TOKENS_PER_GROUP > 4u) {
        b += vec4<f32>(token_dot(w, 4u, u, x_vecs), token_dot(w, 5u, u, x_vecs),
                       token_dot(w, 6u, u, x_vecs), token_dot(w, 7u, u, x_vecs));
    }
    return array<vec4<f32>, 2>(a, b);
}

fn window_sums(u: u32, x_vecs: u32, first: vec4<f32>, second: vec4<f32>) -> array<vec4<f32>, 2> {
    var a = first;
    var b = second;
    a.x += token_sum(0u, u, x_vecs);
    if (TOKENS_PER_GROUP > 1u) { a.y += token_sum(1u, u, x_vecs); }
    if (TOKENS_PER_GROUP > 2u) {
        a.z += token_sum(2u, u, x_vecs);
        a.w += token_sum(3u, u, x_vecs);
    }
    if (TOKENS_PER_GROUP > 4u) {
        b += vec4<f32>(token_sum(4u, u, x_vecs), token_sum(5u, u, x_vecs),
                       token_sum(6u, u, x_vecs), token_sum(7u, u, x_vecs));
    }
    return array<vec4<f32>, 2>(a, b);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.x;
    if (row >= shape.rows) { return; }
    let units = shape.k / 8u;
    let x_vecs = shape.k / 4u;
    var acc_a = vec4<f32>(0.0);  // tokens 0-3 of the window
    var acc_b = vec4<f32>(0.0);  // tokens 4-7
    for (var u0 = 0u; u0 < units; u0 += UNITS_PER_GROUP) {
        var dots = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
        var sums = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
        // a constant trip count, which the driver's compiler unrolls; a row may end mid-group
        for (var i = 0u; i < UNITS_PER_GROUP; i++) {
            let u = u0 + i;
            if (u < units) {
                dots = window_dots(unit_codes(row, u), u, x_vecs, dots[0], dots[1]);
                if (QUANTIZED && !SYMMETRIC) { sums = window_sums(u, x_vecs, sums[0], sums[1]); }
            }
        }
        if (QUANTIZED) {
            let group = row * shape.groups + u0 / UNITS_PER_GROUP;
            let s = group_scale(group);
            acc_a += s * dots[0];
            acc_b += s * dots[1];
            if (!SYMMETRIC) {
                let o = group_offset(group);
                acc_a += o * sums[0];
                acc_b += o * sums[1];
            }
        } else {
            acc_a += dots[0];
            acc_b += dots[1];
        }
    }
    let n = shape.first_row + row;
    // the last window of a call may hold fewer tokens than it has room for
    let tokens = min(TOKENS_PER_GROUP, step.n_tokens - first_token.index);
    for (var i = 0u; i < tokens; i++) {
        let t = select(first_token.index + i, 0u, shape.last_token_only != 0u);
        let index = shape.y_offset + step.start * shape.y_start_stride + t * shape.y_stride + n;
        var value = select(acc_b[i - 4u], acc_a[i], i < 4u);
        if (HAS_BIAS) { value += bias[n]; }
        if (ACCUMULATE) { value += y[index]; }
        y[index] = value;
    }
}
