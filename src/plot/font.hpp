#pragma once
// The plots' built-in 5×7 bitmap font: printable ASCII (32..126), 7 rows per glyph, bit 4 = the leftmost
// of the 5 columns; any other character draws as '?'. A glyph advances 6 columns (one blank between glyphs).
#include <cstdint>
#include <string_view>

namespace lm::plot {

inline constexpr int kGlyphW = 5, kGlyphH = 7, kAdvance = 6;

// The 7 row bitmaps of `ch`.
const uint8_t* glyph(char ch);

// Pixel width of `s` drawn with the font at `scale` (pixels per font pixel).
int text_width(std::string_view s, int scale);

}  // namespace lm::plot
