package handoff

import (
	"encoding/binary"
	"fmt"
)

// Messages of a transfer. The first byte names the kind.
//
//	sender → receiver
//	  'M' manifest                       the encoded, MAC'd manifest
//	  'D' transfer ID[16] first u32 n u32 gens n×u32 pages
//	                                     n consecutive pages from page index first,
//	                                     each PageBytes long, regions in order
//	  'E' transfer ID[16] pages u32      no more pages follow
//	receiver → sender
//	  'V' stage u8 code u8 text          verdict: stage 1 after the manifest
//	                                     (accepted: pages may flow), stage 2 after
//	                                     the import; code 0 = yes, else a reason
const (
	msgManifest = 'M'
	msgData     = 'D'
	msgEnd      = 'E'
	msgVerdict  = 'V'

	stageManifest = 1
	stageImport   = 2

	dataFixed   = 1 + 16 + 4 + 4
	endLen      = 1 + 16 + 4
	maxVerdict  = 1024 // bytes of error text a verdict carries
	defaultData = 1 << 20
)

// dataFrame is a parsed 'D' message; its slices alias the message.
type dataFrame struct {
	id    [16]byte
	first int
	gens  []byte // n little-endian u32
	pages []byte
	n     int
}

func parseData(msg []byte) (dataFrame, error) {
	var f dataFrame
	if len(msg) < dataFixed {
		return f, fmt.Errorf("%w: data frame of %d bytes", ErrProtocol, len(msg))
	}
	copy(f.id[:], msg[1:17])
	f.first = int(binary.LittleEndian.Uint32(msg[17:]))
	n := int64(binary.LittleEndian.Uint32(msg[21:]))
	if n == 0 || int64(len(msg)-dataFixed) < 4*n {
		return f, fmt.Errorf("%w: data frame of %d bytes claims %d pages", ErrProtocol, len(msg), n)
	}
	f.n = int(n)
	f.gens = msg[dataFixed : dataFixed+4*f.n]
	f.pages = msg[dataFixed+4*f.n:]
	return f, nil
}

func appendVerdict(dst []byte, stage uint8, err error) []byte {
	if err == nil {
		return append(dst, msgVerdict, stage, 0)
	}
	text := err.Error()
	if len(text) > maxVerdict {
		text = text[:maxVerdict]
	}
	return append(append(dst, msgVerdict, stage, reasonCode(err)), text...)
}

// parseVerdict returns nil for a yes, a *RefusedError for a no.
func parseVerdict(msg []byte, wantStage uint8) error {
	if len(msg) < 3 || msg[0] != msgVerdict || msg[1] != wantStage {
		return fmt.Errorf("%w: expected a stage-%d verdict, got %d bytes (kind %q)", ErrProtocol, wantStage, len(msg), firstByte(msg))
	}
	if msg[2] == 0 {
		return nil
	}
	stage := "manifest"
	if wantStage == stageImport {
		stage = "import"
	}
	return &RefusedError{Reason: reasonOf(msg[2]), Message: string(msg[3:]), Stage: stage}
}

func firstByte(b []byte) byte {
	if len(b) == 0 {
		return 0
	}
	return b[0]
}
