//go:build !unix

package metrics_test

// processCPU is not measured here: BenchmarkAdmitReleaseObserved reports
// no cpu-ns/op.
func processCPU() int64 { return 0 }
