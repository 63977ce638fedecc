// Softmax of each row (the step's tokens): exp(x - max) / sum. One workgroup per row.
// Constant: ROW_THREADS (a power of two).
struct Shape {
    cols: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> partial: array<f32, ROW_THREADS>;

@compute @workgroup_size(ROW_THREADS)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let row = wid.x + wid.y * groups.x;
    let in_range = row < step.n_tokens;
    let base = row * shape.cols;
    var local_max = MASKED;
    if (in_range) {
        for (var i = lid; i < shape.cols; i += ROW_THREADS) { local_max = max(local_max, x[base + i]); }
    }
    partial[lid] = local_max;
    workgroupBarrier();
    for (var stride = ROW_THREADS / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { partial[lid] = max(partial[lid], partial[lid + stride]); }
        workgroupBarrier();
    }
    let row_max = partial[0];
    workgroupBarrier();
    var local_sum = 0.0;
    if (in_range) {
        for (var i = lid; i < shape.cols; i += ROW_THREADS) { local_sum += exp(x[base + i] - row_max); }
    }
    partial[lid] = local_sum;
    workgroupBarrier();
    for (var stride = ROW_THREADS / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { partial[lid] += partial[lid + stride]; }
        workgroupBarrier();
    }
    if (!in_range) { return; }
    let total = partial[0];
    for (var i = lid; i < shape.cols; i += ROW_THREADS) { y[base + i] = exp(x[base + i] - row_max) / total; }
}
