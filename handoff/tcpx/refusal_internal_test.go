package tcpx

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"
)

// The refusals a flood brings past the first are only counted: the
// accept loop that refuses them over MaxConns spends no allocation on
// each, whatever the logger.
func TestSuppressedRefusalAllocates(t *testing.T) {
	var l refusalLog
	l.init(slog.New(slog.NewTextHandler(io.Discard, nil)), "max_conns")
	l.window = time.Hour
	remote := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 4242}
	err := errors.New("over")
	l.refused(context.Background(), remote, err) // logged; opens the window
	l.refused(context.Background(), remote, err) // counted; arms the timer
	if n := testing.AllocsPerRun(100, func() { l.refused(context.Background(), remote, err) }); n != 0 {
		t.Errorf("a suppressed refusal allocates %v times", n)
	}
	l.stop()
	if l.suppressed != 0 {
		t.Errorf("%d refusals left unsummarised after stop", l.suppressed)
	}
}
