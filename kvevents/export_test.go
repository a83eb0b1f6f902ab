package kvevents

// Subscribed returns how many connected subscribers have at least one
// subscription, so that tests publish only once a subscriber will get it
// (ZMQ's PUB sends nothing before a subscription arrives).
func (p *Publisher) Subscribed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for s := range p.mu.subs {
		s.mu.Lock()
		if len(s.topics) > 0 {
			n++
		}
		s.mu.Unlock()
	}
	return n
}
