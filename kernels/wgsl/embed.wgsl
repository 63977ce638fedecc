// Embedding lookup: out[t, :] = row ids[t] of the table, decoded from its packed bytes
// (weights.wgsl). One dispatch per chunk of table rows; a token whose id lies in another
// chunk is left to that chunk's dispatch. Grid: x over units of the row, y over tokens.
struct Shape {
    rows: u32,       // rows in this chunk
    k: u32,          // row length (hidden size D)
    row_words: u32,
    groups: u32,
    first_row: u32,  // id of the chunk's first row
    pad0: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> weight_words: array<u32>;
@group(0) @binding(4) var<storage, read> weight_scales: array<u32>;
@group(0) @binding(5) var<storage, read> weight_offsets: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let u = gid.x;
    if (t >= step.n_tokens || u * 8u >= shape.k) { return; }
    let id = ids[t];
    if (id < shape.first_row || id >= shape.first_row + shape.rows) { return; }
    let w = weight_unit(id - shape.first_row, u, shape.row_words, shape.groups);
    let base = t * shape.k + u * 8u;
    for (var i = 0u; i < 4u; i++) {
        if (u * 8u + i < shape.k) { out[base + i] = w.lo[i]; }
        if (u * 8u + 4u + i < shape.k) { out[base + 4u + i] = w.hi[i]; }
    }
}
