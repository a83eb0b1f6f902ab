package isolation

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

func TestIsFinitePerDType(t *testing.T) {
	for _, tc := range []struct {
		d      DType
		bits   uint32
		finite bool
		what   string
	}{
		{FP8E4M3, 0x00, true, "+0"},
		{FP8E4M3, 0x80, true, "-0"},
		{FP8E4M3, 0x7e, true, "448, the largest"},
		{FP8E4M3, 0x7f, false, "NaN"},
		{FP8E4M3, 0xff, false, "-NaN"},
		{FP8E4M3, 0x78, true, "256: e4m3 has no infinities"},
		{FP8E5M2, 0x7b, true, "57344, the largest"},
		{FP8E5M2, 0x7c, false, "+Inf"},
		{FP8E5M2, 0xfc, false, "-Inf"},
		{FP8E5M2, 0x7e, false, "NaN"},
		{FP16, 0x7bff, true, "65504, the largest"},
		{FP16, 0x7c00, false, "+Inf"},
		{FP16, 0xfe00, false, "NaN"},
		{FP16, 0x8000, true, "-0"},
		{BF16, 0x7f7f, true, "the largest"},
		{BF16, 0x7f80, false, "+Inf"},
		{BF16, 0xffc1, false, "NaN"},
		{BF16, 0x0001, true, "a subnormal"},
		{FP32, 0x7f7fffff, true, "the largest"},
		{FP32, 0x7f800000, false, "+Inf"},
		{FP32, 0x7fc00000, false, "NaN"},
		{FP32, 0x80000000, true, "-0"},
		{DTypeInvalid, 0, false, "no dtype has no finite numbers"},
	} {
		assert.Equal(t, tc.finite, tc.d.IsFinite(tc.bits), "%v %#x (%s)", tc.d, tc.bits, tc.what)
	}
}

func TestFillSpecPerPolicy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy ScrubPolicy
		d      DType
		want   cudaops.FillSpec
		err    error
	}{
		{"zero", ScrubPolicy{}, BF16, cudaops.FillSpec{}, nil},
		{"zero takes no pattern", ScrubPolicy{Pattern: 1}, BF16, cudaops.FillSpec{}, ErrInvalidPolicy},
		{"poison defaults to -0 in bf16", ScrubPolicy{Kind: ScrubPoison}, BF16, cudaops.FillSpec{Word: 0x80008000}, nil},
		{"poison defaults to -0 in fp8", ScrubPolicy{Kind: ScrubPoison}, FP8E4M3, cudaops.FillSpec{Word: 0x80808080}, nil},
		{"poison defaults to -0 in fp32", ScrubPolicy{Kind: ScrubPoison}, FP32, cudaops.FillSpec{Word: 0x80000000}, nil},
		{"poison 1.0 in fp16", ScrubPolicy{Kind: ScrubPoison, Pattern: 0x3c00}, FP16, cudaops.FillSpec{Word: 0x3c003c00}, nil},
		{"poison NaN in bf16", ScrubPolicy{Kind: ScrubPoison, Pattern: 0x7fc0}, BF16, cudaops.FillSpec{}, ErrNonFinitePattern},
		{"poison Inf in fp16", ScrubPolicy{Kind: ScrubPoison, Pattern: 0x7c00}, FP16, cudaops.FillSpec{}, ErrNonFinitePattern},
		{"poison NaN in e4m3", ScrubPolicy{Kind: ScrubPoison, Pattern: 0x7f}, FP8E4M3, cudaops.FillSpec{}, ErrNonFinitePattern},
		{"poison wider than the dtype", ScrubPolicy{Kind: ScrubPoison, Pattern: 0x100}, FP8E5M2, cudaops.FillSpec{}, ErrInvalidPolicy},
		{"canary", ScrubPolicy{Kind: ScrubCanary, Pattern: 7}, FP16, cudaops.FillSpec{Word: 7, PageSalt: canarySalt, ClearMask: 0x40004000}, nil},
		{"unknown kind", ScrubPolicy{Kind: 9}, BF16, cudaops.FillSpec{}, ErrInvalidPolicy},
		{"unknown dtype", ScrubPolicy{}, DType(42), cudaops.FillSpec{}, ErrInvalidPolicy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.policy.FillSpec(tc.d)
			if tc.err != nil {
				require.ErrorIs(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

// TestCanaryWordsAreFinite checks, for every dtype and many pages, that
// every element of a page's canary word is a finite number: a canary read
// by attention before it is overwritten must not poison it with NaN.
func TestCanaryWordsAreFinite(t *testing.T) {
	for _, d := range []DType{FP8E4M3, FP8E5M2, FP16, BF16, FP32} {
		spec, err := ScrubPolicy{Kind: ScrubCanary}.FillSpec(d)
		require.NoError(t, err)
		width := 8 * d.Size()
		for page := int32(0); page < 4096; page++ {
			w := spec.WordFor(page)
			for shift := 0; shift < 32; shift += width {
				el := (w >> shift) & (1<<width - 1)
				if width == 32 {
					el = w
				}
				require.True(t, d.IsFinite(el), "%v page %d word %#08x element %#x", d, page, w, el)
			}
		}
	}
}

func TestParseNames(t *testing.T) {
	for s, want := range map[string]DType{"fp8": FP8E4M3, "E5M2": FP8E5M2, "half": FP16, "bfloat16": BF16, "float": FP32} {
		got, err := ParseDType(s)
		require.NoError(t, err, s)
		assert.Equal(t, want, got, s)
	}
	_, err := ParseDType("int4")
	assert.ErrorIs(t, err, ErrInvalidPolicy)
	k, err := ParseScrubKind("Canary")
	require.NoError(t, err)
	assert.Equal(t, ScrubCanary, k)
	_, err = ParseScrubKind("shred")
	assert.ErrorIs(t, err, ErrInvalidPolicy)
}

// A pool of several element types (an MLA latent in fp8 with fp32
// scales, a bf16 cache beside fp32 recurrent state) gets one fill word
// that is finite read as each of them, or a refusal naming the dtype it
// would not be finite in.
func TestFillSpecForMixedDTypes(t *testing.T) {
	all := []DType{FP8E4M3, FP8E5M2, FP16, BF16, FP32}
	for _, first := range all {
		for _, other := range all {
			canary, err := ScrubPolicy{Kind: ScrubCanary}.FillSpecFor(first, other)
			require.NoError(t, err)
			for page := int32(0); page < 2048; page++ {
				w := canary.WordFor(page)
				require.True(t, first.wordFinite(w) && other.wordFinite(w), "canary %#08x as %v and %v", w, first, other)
			}
			poison, err := ScrubPolicy{Kind: ScrubPoison}.FillSpecFor(first, other)
			if err != nil {
				require.ErrorIs(t, err, ErrNonFinitePattern)
				require.ErrorContains(t, err, other.String())
				continue
			}
			require.True(t, first.wordFinite(poison.Word) && other.wordFinite(poison.Word), "poison %#08x", poison.Word)
		}
	}
	// The default poisons of the common mixes are finite.
	for _, mix := range [][]DType{{BF16, FP32}, {FP8E4M3, FP32}, {BF16, FP8E4M3, FP32}, {FP16, BF16}} {
		_, err := ScrubPolicy{Kind: ScrubPoison}.FillSpecFor(mix...)
		assert.NoError(t, err, "%v", mix)
	}
	// bf16 NaN-free pattern 0x7f7f repeated reads as fp8 e4m3 0x7f: NaN.
	_, err := ScrubPolicy{Kind: ScrubPoison, Pattern: 0x7f7f}.FillSpecFor(BF16, FP8E4M3)
	assert.ErrorIs(t, err, ErrNonFinitePattern)
	_, err = ScrubPolicy{}.FillSpecFor()
	assert.ErrorIs(t, err, ErrInvalidPolicy)
	_, err = ScrubPolicy{}.FillSpecFor(BF16, DTypeInvalid)
	assert.ErrorIs(t, err, ErrInvalidPolicy)
}
