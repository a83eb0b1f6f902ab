// Package bench holds kvfence's cross-package benchmarks and, under cmd/,
// the kvbench report command. It has no API: the benchmarks live in its
// test files and run with
//
//	go test -run '^$' -bench . -count 10 ./bench | tee new.txt
//	benchstat old.txt new.txt
//
// Each benchmark reports domain units with b.ReportMetric and the ratio to
// a baseline it measures itself, in the same process and on the same
// data, so that a ratio survives a noisy machine better than an absolute
// figure. Each also checks, outside its timed loop, that the operation did
// what the figure claims (admissions counted, pages read back scrubbed or
// filled) and fails otherwise: a figure for a fill that wrote nothing is
// worse than none. bench/README.md lists them with their targets and the figures
// last measured.
package bench
