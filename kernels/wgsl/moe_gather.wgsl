// The tokens routed to one expert, gathered into consecutive rows:
// out[i, :] = x[rows[first + i], :] for i < the step's n_tokens (the expert's token count).
// `rows` holds the layer's route, written by the host: each expert's tokens from its own `first`.
struct Shape {
    dim: u32,    // D, floats per row
    first: u32,  // the expert's first entry in rows
    pad0: u32,
    pad1: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = flat_index(gid, groups, 64u);
    if (i >= step.n_tokens * shape.dim) { return; }
    let r = i / shape.dim;
    out[i] = x[rows[shape.first + r] * shape.dim + i % shape.dim];
}
