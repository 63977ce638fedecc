// Index of each row's largest value (the step's tokens); ties go to the lowest index, as in
// numpy. One workgroup per row. Constant: ROW_THREADS (a power of two).
struct Shape {
    cols: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<u32>;

var<workgroup> best_value: array<f32, ROW_THREADS>;
var<workgroup> best_index: array<u32, ROW_THREADS>;

fn better(value: f32, index: u32, than_value: f32, than_index: u32) -> bool {
    if (index == 0xffffffffu) { return false; }
    if (than_index == 0xffffffffu) { return true; }
    return value > than_value || (value == than_value && index < than_index);
}

@compute @workgroup_size(ROW_THREADS)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let row = wid.x + wid.y * groups.x;
    let in_range = row < step.n_tokens;
    let base = row * shape.cols;
    var value = 0.0;
    var index = 0xffffffffu;  // "none yet": loses every comparison below
    if (in_range && lid < shape.cols) {
        value = x[base + lid];
        index = lid;
        for (var i = lid + ROW_THREADS; i < shape.cols; i += ROW_THREADS) {
            if (better(x[base + i], i, value, index)) { value = x[base + i]; index = i; }
        }
    }
    best_value[lid] = value;
    best_index[lid] = index;
    workgroupBarrier();
    for (var stride = ROW_THREADS / 2u; stride > 0u; stride >>= 1u) {
        let other = lid + stride;
        if (lid < stride && better(best_value[other], best_index[other], best_value[lid], best_index[lid])) {
            best_value[lid] = best_value[other];
            best_index[lid] = best_index[other];
        }
        workgroupBarrier();
    }
    if (in_range && lid == 0u) { y[row] = best_index[0]; }
}
