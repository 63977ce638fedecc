// Rotary embedding, half-split layout (edge/rope.py): a head vector [x1, x2] becomes
// [x1 * cos - x2 * sin, x2 * cos + x1 * sin], with cos/sin [T, Dh/2] for the step's positions.
// One thread per (token, head, pair); y may be the KV cache, written at the step's start.
struct Shape {
    heads: u32,
    head_dim: u32,
    x_offset: u32,
    y_offset: u32,         // y[t, h, d] = y[y_offset + start * y_start_stride + (t * heads + h) * head_dim + d]
    y_start_stride: u32,
    pad0: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> cos: array<f32>;
@group(0) @binding(4) var<storage, read> sin: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let half = shape.head_dim / 2u;
    let index = flat_index(gid, groups, 64u);
    if (index >= step.n_tokens * shape.heads * half) { return; }
    let i = index % half;
    let head_row = index / half;  // t * heads + h
    let t = head_row / shape.heads;
    let c = cos[t * half + i];
    let s = sin[t * half + i];
    let src = shape.x_offset + head_row * shape.head_dim + i;
    let dst = shape.y_offset + step.start * shape.y_start_stride + head_row * shape.head_dim + i;
    let x1 = x[src];
    let x2 = x[src + half];
    y[dst] = x1 * c - x2 * s;
    y[dst + half] = x2 * c + x1 * s;
}
