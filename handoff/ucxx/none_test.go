//go:build !cgo || !ucx

package ucxx_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/ucxx"
)

// Without UCX (no cgo, or built without the tag ucx) the package builds
// and every constructor reports ErrUnavailable; what it refuses in every
// build (a nil receiver, Options that cannot work) it refuses here too.
func TestUnavailable(t *testing.T) {
	assert.ErrorIs(t, ucxx.Available(), ucxx.ErrUnavailable)
	_, err := ucxx.Dial("127.0.0.1:1", ucxx.Options{})
	assert.ErrorIs(t, err, ucxx.ErrUnavailable)
	_, err = ucxx.Dial("127.0.0.1:1", ucxx.Options{MessageTimeout: -1})
	assert.ErrorIs(t, err, handoff.ErrInvalidConfig)

	pool, err := testkit.NewPool(testkit.PoolConfig{Pages: 16})
	require.NoError(t, err)
	defer pool.Close()
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: pool, Key: testkit.Key()})
	require.NoError(t, err)
	_, err = ucxx.NewServer(recv, ucxx.Options{})
	assert.ErrorIs(t, err, ucxx.ErrUnavailable)
	_, err = ucxx.NewServer(nil, ucxx.Options{})
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
	_, err = ucxx.NewServer(recv, ucxx.Options{MaxConns: -1})
	assert.ErrorIs(t, err, handoff.ErrInvalidConfig)

	var tr *ucxx.Transport
	_, err = tr.Open(context.Background())
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
	assert.ErrorIs(t, tr.Close(), handoff.ErrInvalidArgument)
	var srv *ucxx.Server
	_, err = srv.Listen("127.0.0.1:0")
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
	assert.ErrorIs(t, srv.Close(), handoff.ErrInvalidArgument)
	assert.ErrorIs(t, srv.Shutdown(context.Background()), handoff.ErrInvalidArgument)
	assert.Equal(t, ucxx.ServerStats{}, srv.Stats())
}
