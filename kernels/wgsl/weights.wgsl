// Decoding weight rows straight from zllm's packed bytes (quant/formats.py), eight
// consecutive inputs k = 8u .. 8u+7 ("unit u") of one row at a time.
//
// Constants: WEIGHT_KIND (0 int4, 1 int8, 2 f16, 3 f32), SYMMETRIC, GROUP_SIZE, SCALES_F32.
// The kernel declares weight_words, weight_scales and weight_offsets (all array<u32>):
//   int4: row r is row_words = K_padded / 8 words; word j holds codes 8j..8j+7, code i of the
//         word in bits 4i..4i+3 (the checkpoint's bytes read little-endian: low nibble first).
//   int8: row_words = K_padded / 4; code i of the word in bits 8i..8i+7.
//   f16:  row_words = K_padded / 2; two halves per word, low half first.
//   f32:  row_words = K_padded; the words are the floats' bits.
//   scales / offsets: the f16 [N, n_groups] arrays as they are stored, two halves per word; with
//         SCALES_F32 the f32 arrays (GGUF's K-quants), one float per word.
// Values: w = s * (q - zero) (symmetric, zero 8 or 128) or w = s * q + o (affine), in f32.

struct Unit {
    lo: vec4<f32>,  // inputs 8u .. 8u+3
    hi: vec4<f32>,  // inputs 8u+4 .. 8u+7
}

fn half_at(word: u32, index: u32) -> f32 {
    let pair = unpack2x16float(word);
    return select(pair.x, pair.y, (index & 1u) == 1u);
}

fn group_scale(index: u32) -> f32 {
    if (SCALES_F32) {
        return bitcast<f32>(weight_scales[index]);
    }
    return half_at(weight_scales[index >> 1u], index);
}

fn group_offset(index: u32) -> f32 {
    if (SCALES_F32) {
        return bitcast<f32>(weight_offsets[index]);
    }
    return half_at(weight_offsets[index >> 1u], index);
}

// codes (already as f32) -> weights, for the group that unit u of row `row` falls in
fn dequantize_codes(codes_lo: vec4<f32>, codes_hi: vec4<f32>, row: u32, u: u32, groups: u32) -> Unit {
    let group = row * groups + (u * 8u) / GROUP_SIZE;
    let s = group_scale(group);
    if (SYMMETRIC) {
        let zero = select(128.0, 8.0, WEIGHT_KIND == 0u);
        return Unit(s * (codes_lo - zero), s * (codes_hi - zero));
    }
    let o = group_offset(group);
    return Unit(s * codes_lo + o, s * codes_hi + o);
}

fn weight_unit(row: u32, u: u32, row_words: u32, groups: u32) -> Unit {
    if (WEIGHT_KIND == 0u) {
        let w = weight_words[row * row_words + u];
        let lo = (vec4<u32>(w, w >> 4u, w >> 8u, w >> 12u)) & vec4<u32>(15u);
        let hi = (vec4<u32>(w >> 16u, w >> 20u, w >> 24u, w >> 28u)) & vec4<u32>(15u);
        return dequantize_codes(vec4<f32>(lo), vec4<f32>(hi), row, u, groups);
    }
    if (WEIGHT_KIND == 1u) {
        let base = row * row_words + 2u * u;
        let a = weight_words[base];
        let b = weight_words[base + 1u];
        let lo = vec4<u32>(a, a >> 8u, a >> 16u, a >> 24u) & vec4<u32>(255u);
        let hi = vec4<u32>(b, b >> 8u, b >> 16u, b >> 24u) & vec4<u32>(255u);
        return dequantize_codes(vec4<f32>(lo), vec4<f32>(hi), row, u, groups);
    }
    if (WEIGHT_KIND == 2u) {
        let base = row * row_words + 4u * u;
        let a = unpack2x16float(weight_words[base]);
        let b = unpack2x16float(weight_words[base + 1u]);
        let c = unpack2x16float(weight_words[base + 2u]);
        let d = unpack2x16float(weight_words[base + 3u]);
        return Unit(vec4<f32>(a, b), vec4<f32>(c, d));
    }
    let base = row * row_words + 8u * u;
    return Unit(
        bitcast<vec4<f32>>(vec4<u32>(weight_words[base], weight_words[base + 1u],
                                     weight_words[base + 2u], weight_words[base + 3u])),
        bitcast<vec4<f32>>(vec4<u32>(weight_words[base + 4u], weight_words[base + 5u],
                                     weight_words[base + 6u], weight_words[base + 7u])));
}
