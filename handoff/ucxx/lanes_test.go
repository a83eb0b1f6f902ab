//go:build cgo && ucx

package ucxx

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// What ucp_ep_print_info says of an endpoint over shared memory and over
// TCP (UCX 1.13, this package's tests), and of one over InfiniBand.
const (
	smLanes = `#
#                 lane[0]:  1:sysv/memory.0 md[1]           -> md[1]/sysv/sysdev[255] am am_bw#0
#                 lane[1]:  2:posix/memory.0 md[2]          -> md[2]/posix/sysdev[255]
#                 lane[2]:  3:cma/memory.0 md[3]            -> md[3]/cma/sysdev[255] rma_bw#0
#                 am_send: 0..<egr/short>..93..<egr/bcopy>..32768..<rndv>..(inf)
`
	tcpLanes = `#
#                 lane[0]:  1:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] rma_bw#0 am am_bw#0
#                 lane[1]:  0:tcp/eth0.0 md[0]              -> md[0]/tcp/sysdev[255] rma_bw#1 wireup
`
	ibLanes = `#
#                 lane[0]:  2:rc_mlx5/mlx5_0:1.0 md[1]      -> md[1]/ib/sysdev[0] rma_bw#0 am am_bw#0
#                 lane[1]:  1:posix/memory.0 md[0]          -> md[0]/posix/sysdev[255]
`
)

// The bytes land on the receiver's threads over shared memory's queues
// and TCP, not where a NIC writes them; TCP alone is only TCP.
func TestLanesSayWhereBytesLand(t *testing.T) {
	assert.True(t, landsHere(smLanes))
	assert.True(t, landsHere(tcpLanes))
	assert.False(t, landsHere(ibLanes))
	assert.False(t, landsHere(""), "no lane")
	assert.True(t, tcpOnly(tcpLanes))
	assert.False(t, tcpOnly(smLanes))
	assert.False(t, tcpOnly(""))
}
