// out = silu(gate) * up, elementwise over the step's tokens.
struct Shape {
    per_token: u32,  // elements per token (the intermediate size)
    pad0: u32,
    pad1: u32,
    pad2: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> gate: array<f32>;
@group(0) @binding(3) var<storage, read> up: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = flat_index(gid, groups, 64u);
    if (i >= step.n_tokens * shape.per_token) { return; }
    let g = gate[i];
    // exp(-g) overflows to inf for very negative g; g / inf = 0 is silu's limit there
    out[i] = g / (1.0 + exp(-g)) * up[i];
}
