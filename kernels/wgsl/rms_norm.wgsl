// RMSNorm of each row: y = x / sqrt(mean(x^2) + eps) * weight. One workgroup per row; the
// rows are the step's tokens times rows_per_token (1, or the heads for Qwen3's q/k norm).
// Constant: NORM_THREADS (a power of two).
struct Shape {
    dim: u32,             // row length
    rows_per_token: u32,
    x_offset: u32,
    y_offset: u32,        // y row r starts at y_offset + start * y_start_stride + r * dim
    y_start_stride: u32,
    eps: f32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> weight: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

var<workgroup> partial: array<f32, NORM_THREADS>;

@compute @workgroup_size(NORM_THREADS)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let row = wid.x + wid.y * groups.x;
    let in_range = row < step.n_tokens * shape.rows_per_token;
    let x_row = shape.x_offset + row * shape.dim;
    var sum_sq = 0.0;
    if (in_range) {
        for (var i = lid; i < shape.dim; i += NORM_THREADS) {
            let v = x[x_row + i];
            sum_sq += v * v;
        }
    }
    partial[lid] = sum_sq;
    workgroupBarrier();
    for (var stride = NORM_THREADS / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { partial[lid] += partial[lid + stride]; }
        workgroupBarrier();
    }
    if (!in_range) { return; }
    let rms = sqrt(partial[0] / f32(shape.dim) + shape.eps);
    let y_row = shape.y_offset + step.start * shape.y_start_stride + row * shape.dim;
    for (var i = lid; i < shape.dim; i += NORM_THREADS) {
        y[y_row + i] = (x[x_row + i] / rms) * weight[i];
    }
}
