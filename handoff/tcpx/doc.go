// Package tcpx is a handoff.Transport over plain TCP or TLS connections.
package tcpx
