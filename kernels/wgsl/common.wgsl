// Shared by every kernel. The host prepends `const NAME = value;` lines for each kernel's
// compile-time constants (devices/gpu/shaders.py), then this file, then the kernel's own.
//
// Step: what changes from one forward call to the next, written once per call so that the
// per-dispatch Shape uniforms (and the bind groups holding them) are built once.
struct Step {
    n_tokens: u32,  // T, tokens in this call
    start: u32,     // position of the first of them (tokens already in the KV cache)
    pad0: u32,
    pad1: u32,
}
@group(0) @binding(0) var<uniform> step: Step;

// -inf stand-in for masked attention scores: exp(MASKED - m) is exactly 0 for any finite m.
const MASKED: f32 = -3.0e38;

// Element index of a flat dispatch: the host spreads large launches over x and y.
fn flat_index(id: vec3<u32>, groups: vec3<u32>, width: u32) -> u32 {
    return id.x + id.y * groups.x * width;
}
