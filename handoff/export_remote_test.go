package handoff

import "fmt"

// SignGrantForTest signs a grant message whose MAC is missing (kind and
// signed bytes), as a receiver would.
func SignGrantForTest(msg []byte, key *Key) []byte { return grantMAC(msg, key, msg[1:]) }

// GrantPiece is where a grant puts one lane's share of a unit: Len bytes
// at Off of extent Mem.
type GrantPiece struct {
	Unit, Mem int
	Off, Len  int64
}

// GrantPiecesForTest reads a grant message signed with key and returns
// where it puts every unit, lane by lane.
func GrantPiecesForTest(msg []byte, key *Key) ([]GrantPiece, error) {
	if len(msg) < 17 {
		return nil, fmt.Errorf("%w: grant of %d bytes", ErrProtocol, len(msg))
	}
	var id [16]byte
	copy(id[:], msg[1:17])
	g, err := parseGrant(msg, key, id)
	if err != nil {
		return nil, err
	}
	p := placeGrant(g)
	var pieces []GrantPiece
	for li, l := range g.lanes {
		for j := range l.units {
			pieces = append(pieces, GrantPiece{Unit: l.first + j, Mem: int(p.extent[li][j]), Off: p.off[li][j], Len: int64(l.unitBytes)})
		}
	}
	return pieces, nil
}
