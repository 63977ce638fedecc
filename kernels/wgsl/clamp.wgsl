// y = x clamped to [-limit, limit] (OLMoE's clip_qkv on q, k and v after their projections).
// y[y_offset + start * y_start_stride + i] for the step's n_tokens * per_token elements i, so that
// values can be written straight into the KV cache at the call's first position.
struct Shape {
    per_token: u32,
    y_start_stride: u32,
    limit: f32,
    pad0: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = flat_index(gid, groups, 64u);
    if (i >= step.n_tokens * shape.per_token) { return; }
    y[step.start * shape.y_start_stride + i] = clamp(x[i], -shape.limit, shape.limit);
}
