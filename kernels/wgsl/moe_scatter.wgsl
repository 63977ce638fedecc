// One expert's outputs added to the tokens that chose it, scaled by their route weights:
// out[rows[first + i], :] += route_weights[first + i] * y[i, :] for i < the step's n_tokens.
// A token chooses an expert at most once, so no two invocations of a dispatch write one element;
// experts are dispatched one after another in ascending id order (the reference's order).
struct Shape {
    dim: u32,
    first: u32,
    pad0: u32,
    pad1: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read> route_weights: array<f32>;
@group(0) @binding(4) var<storage, read> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = flat_index(gid, groups, 64u);
    if (i >= step.n_tokens * shape.dim) { return; }
    let r = i / shape.dim;
    let index = rows[shape.first + r] * shape.dim + i % shape.dim;
    out[index] = out[index] + route_weights[shape.first + r] * y[i];
}
