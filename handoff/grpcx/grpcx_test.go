package grpcx_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

var tenants = []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}

func newPool(t testing.TB, pages int) *kvcache.Pool {
	p, err := testkit.NewPool(testkit.PoolConfig{Pages: pages, Tenants: tenants})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// serve starts a handoff server for decode on a loopback port.
func serve(t testing.TB, decode *kvcache.Pool, creds credentials.TransportCredentials) (*handoff.Receiver, string, func()) {
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key()})
	require.NoError(t, err)
	srv, err := grpcx.NewServer(recv, creds)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return recv, ln.Addr().String(), srv.Stop
}

func newSender(t testing.TB, reclaim time.Duration) *handoff.Sender {
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), ReclaimAfter: reclaim, FrameBytes: 32 << 10})
	require.NoError(t, err)
	return s
}

func TestRefusesNilCredentials(t *testing.T) {
	_, err := grpcx.Dial("127.0.0.1:1", nil)
	assert.ErrorIs(t, err, grpcx.ErrNoCredentials)
	_, err = grpcx.NewServer(nil, nil)
	assert.ErrorIs(t, err, grpcx.ErrNoCredentials)
}

func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvfence decode"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	roots := x509.NewCertPool()
	roots.AddCert(cert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, roots
}

func TestTLSHandoff(t *testing.T) {
	cert, roots := selfSigned(t)
	prefill, decode := newPool(t, 512), newPool(t, 1024)
	recv, addr, _ := serve(t, decode, credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}))
	ctx := context.Background()
	s := newSender(t, time.Minute)

	// A client that does not trust the server's certificate never gets
	// to send a byte; the export stays pinned.
	untrusted, err := grpcx.Dial(addr, credentials.NewTLS(&tls.Config{RootCAs: x509.NewCertPool(), ServerName: "127.0.0.1"}))
	require.NoError(t, err)
	defer untrusted.Close()
	l, err := testkit.Prefill(prefill, "tls-1", "victim", 300*16)
	require.NoError(t, err)
	exp, err := s.Export(l, 64)
	require.NoError(t, err)
	err = exp.Send(ctx, untrusted)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.True(t, exp.Live())

	tr, err := grpcx.Dial(addr, credentials.NewTLS(&tls.Config{RootCAs: roots, ServerName: "127.0.0.1"}))
	require.NoError(t, err)
	defer tr.Close()
	require.NoError(t, exp.Send(ctx, tr))
	dl, ok := recv.Take("tls-1")
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, "tls-1"))
	require.NoError(t, dl.Release())
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}

// TestTwoProcesses moves real page bytes to a decode pool in another OS
// process over loopback gRPC, and audits that process's pool.
func TestTwoProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a helper binary")
	}
	bin := filepath.Join(t.TempDir(), "peer")
	build := exec.Command(goTool(t), "build", "-o", bin, "github.com/kvfence/kvfence/handoff/grpcx/internal/peer")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)

	peer := exec.Command(bin, "-pages", "4096")
	stdin, err := peer.StdinPipe()
	require.NoError(t, err)
	stdout, err := peer.StdoutPipe()
	require.NoError(t, err)
	peer.Stderr = os.Stderr
	require.NoError(t, peer.Start())
	t.Cleanup(func() { stdin.Close(); peer.Wait() })
	lines := bufio.NewScanner(stdout)
	ask := func(cmd string) string {
		if cmd != "" {
			_, err := io.WriteString(stdin, cmd+"\n")
			require.NoError(t, err)
		}
		require.True(t, lines.Scan(), "peer exited: %v", lines.Err())
		return lines.Text()
	}
	addr, ok := strings.CutPrefix(ask(""), "addr ")
	require.True(t, ok)

	prefill := newPool(t, 2048)
	tr, err := grpcx.Dial(addr, insecure.NewCredentials())
	require.NoError(t, err)
	defer tr.Close()
	s := newSender(t, time.Minute)
	ctx := context.Background()
	for _, tc := range []struct {
		id     string
		prompt int
	}{{"first", 1}, {"second", 16}, {"third", 1500*16 + 7}} {
		l, err := testkit.Prefill(prefill, tc.id, "victim", tc.prompt)
		require.NoError(t, err)
		exp, err := s.Export(l, 128)
		require.NoError(t, err)
		require.NoError(t, exp.Send(ctx, tr))
		assert.False(t, l.Live())
		assert.Equal(t, "ok "+tc.id+" prefilled "+strconv.Itoa(tc.prompt), ask("take "+tc.id))
	}
	// A replay of a manifest the peer imported is refused across processes.
	l, err := testkit.Prefill(prefill, "first", "victim", 1)
	require.NoError(t, err)
	exp, err := s.Export(l, 128)
	require.NoError(t, err)
	err = exp.Send(ctx, tr)
	assert.ErrorIs(t, err, handoff.ErrReplay)
	require.NoError(t, exp.Abort())

	assert.Equal(t, "ok imported 3 refused 1", ask("stats"))
	assert.Equal(t, "ok sweep", ask("sweep"))
	require.NoError(t, testkit.Sweep(prefill))
}

func goTool(t *testing.T) string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	p := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(p); err != nil {
		t.Skip("no go command to build the helper")
	}
	return p
}
