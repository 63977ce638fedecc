// The MoE block's output joins the residual stream:
// hidden[t, :] += routed[t, :] + s_t * shared[t, :], where s_t = sigmoid(shared_gate[t]) when the
// shared expert is gated (Qwen2-MoE), 1 otherwise; without a shared expert, hidden += routed.
// The sum is formed in the reference's order: (routed + gated shared), then added to hidden.
// Constants: HAS_SHARED, GATED.
struct Shape {
    dim: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read> routed: array<f32>;
@group(0) @binding(3) var<storage, read> shared_out: array<f32>;
@group(0) @binding(4) var<storage, read> shared_gate: array<f32>;
@group(0) @binding(5) var<storage, read_write> hidden: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = flat_index(gid, groups, 64u);
    if (i >= step.n_tokens * shape.dim) { return; }
    var block = routed[i];
    if (HAS_SHARED) {
        var shared_value = shared_out[i];
        if (GATED) {
            shared_value = shared_value * (1.0 / (1.0 + exp(-shared_gate[i / shape.dim])));
        }
        block = block + shared_value;
    }
    hidden[i] = hidden[i] + block;
}
