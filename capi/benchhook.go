//go:build cgo

package main

/*
#include <stdlib.h>
#include "kvfence.h"

// kvf__bench_admit_release admits and releases one request n times through
// the exported C ABI, as an engine written in C would: every call crosses
// from C into Go. It stops at the first error and returns its status, or
// -1 if a block table was not table_len pages long (the request's pages,
// all of them); table holds the last cycle's.
static inline kvf_status kvf__bench_admit_release(kvf_pool pool, char *id, char *tenant,
                                                  int64_t tokens, int32_t *table, size_t table_len, int n) {
	for (int i = 0; i < n; i++) {
		kvf_lease lease;
		size_t len = 0;
		kvf_status st = kvf_admit(pool, id, tenant, tokens, 0, 0, &lease);
		if (st == 0) st = kvf_lease_block_table(lease, table, table_len, &len);
		if (st == 0 && len != table_len) st = -1;
		if (st == 0) st = kvf_lease_release(lease, 0, 0);
		if (st == 0) st = kvf_lease_free(lease);
		if (st != 0) return st;
	}
	return 0;
}
*/
import "C"

import "unsafe"

// cAdmitRelease runs n admit → block table → release → free cycles from C
// on pool, for BenchmarkCAdmitRelease (test files cannot use cgo), and
// returns the first failed status, -1 for a block table shorter than
// table, or 0; table is left holding the last cycle's block table. It is
// linked into the library only if called, which the library never does.
func cAdmitRelease(pool uint64, id, tenant string, tokens int64, table []int32, n int) int32 {
	cid, ctenant := C.CString(id), C.CString(tenant)
	defer C.free(unsafe.Pointer(cid))
	defer C.free(unsafe.Pointer(ctenant))
	return int32(C.kvf__bench_admit_release(C.kvf_pool(pool), cid, ctenant, C.int64_t(tokens),
		(*C.int32_t)(unsafe.Pointer(unsafe.SliceData(table))), C.size_t(len(table)), C.int(n)))
}
