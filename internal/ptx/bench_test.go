package ptx

import "testing"

// BenchmarkRunLoop measures the interpreter's cost per instruction on a
// counting loop (3 instructions an iteration) over 256 threads.
func BenchmarkRunLoop(b *testing.B) {
	m, err := Parse([]byte(kernel(`mov.u32 %r1, 0;
L:
	add.u32 %r1, %r1, 1;
	setp.lt.u32 %p1, %r1, 1000;
	@%p1 bra L;
	ret;`)))
	if err != nil {
		b.Fatal(err)
	}
	e, _ := m.Entry("k")
	params, _ := e.Pack([]Arg{U64("k_out", 0), U64("k_in", 0)})
	var st Stats
	for b.Loop() {
		st, err = e.Run(Launch{Grid: [3]uint32{1, 1, 1}, Block: [3]uint32{256, 1, 1}, Params: params, Mem: &mem{}, Budget: 1 << 30})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(st.Instructions), "ns/instr")
}
