#include "textflag.h"

// Streaming (non-temporal) fills. Both take a 16-byte aligned dst whose
// length n is a positive multiple of 128; the Go side guarantees both.

// func fillNTSSE2(dst unsafe.Pointer, n uintptr, w uint32)
TEXT ·fillNTSSE2(SB), NOSPLIT, $0-20
	MOVQ dst+0(FP), DI
	MOVQ n+8(FP), CX
	MOVL w+16(FP), AX
	MOVQ AX, X0
	PSHUFD $0, X0, X0
sse2loop:
	MOVNTO X0, 0(DI)
	MOVNTO X0, 16(DI)
	MOVNTO X0, 32(DI)
	MOVNTO X0, 48(DI)
	MOVNTO X0, 64(DI)
	MOVNTO X0, 80(DI)
	MOVNTO X0, 96(DI)
	MOVNTO X0, 112(DI)
	ADDQ $128, DI
	SUBQ $128, CX
	JNZ sse2loop
	SFENCE
	RET

// func fillNTAVX2(dst unsafe.Pointer, n uintptr, w uint32)
// dst must be 32-byte aligned here.
TEXT ·fillNTAVX2(SB), NOSPLIT, $0-20
	MOVQ dst+0(FP), DI
	MOVQ n+8(FP), CX
	MOVL w+16(FP), AX
	MOVQ AX, X0
	VPBROADCASTD X0, Y0
avx2loop:
	VMOVNTDQ Y0, 0(DI)
	VMOVNTDQ Y0, 32(DI)
	VMOVNTDQ Y0, 64(DI)
	VMOVNTDQ Y0, 96(DI)
	ADDQ $128, DI
	SUBQ $128, CX
	JNZ avx2loop
	SFENCE
	VZEROUPPER
	RET
