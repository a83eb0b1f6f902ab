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

// Streaming copy. dst must be 32-byte aligned (16 for SSE2) and n a
// positive multiple of 128; src may have any alignment.

// func copyNTSSE2(dst, src unsafe.Pointer, n uintptr)
TEXT ·copyNTSSE2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
sse2copy:
	MOVOU 0(SI), X0
	MOVOU 16(SI), X1
	MOVOU 32(SI), X2
	MOVOU 48(SI), X3
	MOVOU 64(SI), X4
	MOVOU 80(SI), X5
	MOVOU 96(SI), X6
	MOVOU 112(SI), X7
	MOVNTO X0, 0(DI)
	MOVNTO X1, 16(DI)
	MOVNTO X2, 32(DI)
	MOVNTO X3, 48(DI)
	MOVNTO X4, 64(DI)
	MOVNTO X5, 80(DI)
	MOVNTO X6, 96(DI)
	MOVNTO X7, 112(DI)
	ADDQ $128, SI
	ADDQ $128, DI
	SUBQ $128, CX
	JNZ sse2copy
	SFENCE
	RET

// func copyNTAVX2(dst, src unsafe.Pointer, n uintptr)
TEXT ·copyNTAVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
avx2copy:
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VMOVNTDQ Y0, 0(DI)
	VMOVNTDQ Y1, 32(DI)
	VMOVNTDQ Y2, 64(DI)
	VMOVNTDQ Y3, 96(DI)
	ADDQ $128, SI
	ADDQ $128, DI
	SUBQ $128, CX
	JNZ avx2copy
	SFENCE
	VZEROUPPER
	RET
