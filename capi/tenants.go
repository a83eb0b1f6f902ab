//go:build cgo

package main

// Tenant administration: by name and numbers (ABI 1) and as one object of
// the config's "tenants" list (ABI 2).

// #include "lasterror.h"
import "C"

import (
	"math"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// tenantConfig translates the arguments of the ABI-1 tenant calls. A name
// too long to read is refused as the registry refuses a name it cannot
// hold: nameErr is isolation.ErrInvalidTenant for an addition and
// ErrUnknownTenant for an update (no tenant has such a name).
func tenantConfig(name *C.char, quota, reserved C.int64_t, nameErr error) (kvcache.TenantConfig, error) {
	n, err := cString(name, "name", nameErr)
	if err != nil {
		return kvcache.TenantConfig{}, err
	}
	// Out-of-range counts become -1, which the registry refuses with its
	// own error.
	clamp := func(v C.int64_t) int {
		if v < 0 || int64(v) > math.MaxInt32 {
			return -1
		}
		return int(v)
	}
	return kvcache.TenantConfig{Name: n, QuotaPages: clamp(quota), ReservedPages: clamp(reserved)}, nil
}

//export kvf_pool_add_tenant
func kvf_pool_add_tenant(pool C.kvf_pool, name *C.char, quotaPages, reservedPages C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	tc, err := tenantConfig(name, quotaPages, reservedPages, isolation.ErrInvalidTenant)
	if err != nil {
		return fail(err)
	}
	return result(bridge.AddTenant(uint64(pool), tc))
}

//export kvf_pool_update_tenant
func kvf_pool_update_tenant(pool C.kvf_pool, name *C.char, quotaPages, reservedPages C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	tc, err := tenantConfig(name, quotaPages, reservedPages, isolation.ErrUnknownTenant)
	if err != nil {
		return fail(err)
	}
	return result(bridge.UpdateTenantQuota(uint64(pool), tc))
}

//export kvf_pool_add_tenant_json
func kvf_pool_add_tenant_json(pool C.kvf_pool, tenantJSON *C.char) (st C.kvf_status) {
	defer guard(&st)
	js, err := cString(tenantJSON, "tenant_json", isolation.ErrInvalidTenant)
	if err != nil {
		return fail(err)
	}
	tc, err := bridge.ParseTenant([]byte(js))
	if err != nil {
		return fail(err)
	}
	return result(bridge.AddTenant(uint64(pool), tc))
}

//export kvf_pool_update_tenant_json
func kvf_pool_update_tenant_json(pool C.kvf_pool, tenantJSON *C.char) (st C.kvf_status) {
	defer guard(&st)
	js, err := cString(tenantJSON, "tenant_json", isolation.ErrInvalidTenant)
	if err != nil {
		return fail(err)
	}
	tc, err := bridge.ParseTenant([]byte(js))
	if err != nil {
		return fail(err)
	}
	return result(bridge.UpdateTenant(uint64(pool), tc))
}
