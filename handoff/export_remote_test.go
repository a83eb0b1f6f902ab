package handoff

// SignGrantForTest signs a grant message whose MAC is missing (kind and
// signed bytes), as a receiver would.
func SignGrantForTest(msg []byte, key *Key) []byte { return grantMAC(msg, key, msg[1:]) }
