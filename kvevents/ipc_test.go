package kvevents_test

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvevents"
)

// ipcPath is a socket path short enough for sun_path on every platform.
func ipcPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvf")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "events.sock")
}

// TestIPCEndpointServesSubscribers: an ipc:// endpoint is a Unix socket
// subscribers connect to, removed when the publisher closes.
func TestIPCEndpointServesSubscribers(t *testing.T) {
	path := ipcPath(t)
	pub := publisher(t, newPool(t, 64, 64), kvevents.Config{Endpoint: "ipc://" + path})
	assert.Equal(t, path, pub.Addr().String())
	c, err := kvevents.DialPeer("ipc://"+path, "SUB", 10*time.Second)
	require.NoError(t, err)
	c.Conn().Close()
	require.NoError(t, pub.Close())
	_, err = os.Lstat(path)
	assert.ErrorIs(t, err, os.ErrNotExist, "the socket file outlived its publisher")
}

// TestIPCEndpointOnAFileIsRefusedAndTheFileKept: a mistyped endpoint that
// names a regular file must not delete it (the publisher may run as a
// user who can): New fails, naming the endpoint, and the file is as it
// was.
func TestIPCEndpointOnAFileIsRefusedAndTheFileKept(t *testing.T) {
	path := ipcPath(t)
	require.NoError(t, os.WriteFile(path, []byte("not a socket"), 0o600))
	_, err := kvevents.New(newPool(t, 64, 64), kvevents.Config{Endpoint: "ipc://" + path})
	require.ErrorIs(t, err, kvevents.ErrListen)
	got, rerr := os.ReadFile(path)
	require.NoError(t, rerr, "the file was removed")
	assert.Equal(t, "not a socket", string(got))
}

// TestIPCEndpointOfALivePublisherIsRefused: a second publisher on the path
// of a live one is refused, and the first keeps its socket and its
// subscribers (removing the file would leave it listening on nothing).
func TestIPCEndpointOfALivePublisherIsRefused(t *testing.T) {
	path := ipcPath(t)
	publisher(t, newPool(t, 64, 64), kvevents.Config{Endpoint: "ipc://" + path})
	_, err := kvevents.New(newPool(t, 64, 64), kvevents.Config{Endpoint: "ipc://" + path})
	require.ErrorIs(t, err, kvevents.ErrListen)
	c, err := kvevents.DialPeer("ipc://"+path, "SUB", 10*time.Second)
	require.NoError(t, err, "the first publisher lost its socket")
	c.Conn().Close()
}

// TestIPCEndpointTakesOverAStaleSocket: a socket file left by a publisher
// that died (nobody listens on it) is taken over.
func TestIPCEndpointTakesOverAStaleSocket(t *testing.T) {
	path := ipcPath(t)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	l.SetUnlinkOnClose(false)
	require.NoError(t, l.Close()) // as a killed process leaves it
	_, err = os.Lstat(path)
	require.NoError(t, err)
	publisher(t, newPool(t, 64, 64), kvevents.Config{Endpoint: "ipc://" + path})
	c, err := kvevents.DialPeer("ipc://"+path, "SUB", 10*time.Second)
	require.NoError(t, err)
	c.Conn().Close()
}
