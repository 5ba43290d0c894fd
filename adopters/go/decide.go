package pdpolicy

import (
	"math"
	"sort"
)

// Reason says which rule decided (docs/policy-format.md, "Decision rule").
type Reason uint8

const (
	ReasonTable         Reason = iota // the cell's route
	ReasonExplore                     // the cell's other route, drawn with its exploration
	ReasonFirstTurn                   // override: turn 1
	ReasonBusyPrefill                 // override: turn 1 decode-local, prefill pool busy
	ReasonBusyLaterTurn               // override: a later turn's prefill cell, pool busy
	ReasonBypass                      // override: append below the bypass threshold
	ReasonInvalidInput                // NaN, infinite, negative or zero-output features
	ReasonTimeout                     // set by a router: the decision took too long
	ReasonNoPolicy                    // set by a router: no policy loaded yet
)

var reasonNames = [...]string{"table", "explore", "first_turn", "busy_prefill",
	"busy_later_turn", "bypass", "invalid_input", "timeout", "no_policy"}

// String is the reason's label value (pdrouter_decisions_total{reason}).
func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "unknown"
}

// Reasons lists every reason, in label order.
func Reasons() []Reason {
	out := make([]Reason, len(reasonNames))
	for i := range out {
		out[i] = Reason(i)
	}
	return out
}

// Features is what a router knows about a request when it must route it.
//
// PrefillWaiting is the number of requests waiting on the least-busy prefill worker as the
// router sees it; leave it 0 (or NaN) when unknown: the busy overrides never fire then (a
// bar is at least 1), and an unknown, NaN, infinite or negative value is not invalid input.
type Features struct {
	Turn                 int64
	ContextTokens        float64
	AppendTokens         float64
	ExpectedOutputTokens float64
	QPS                  float64
	PrefillWaiting       float64
}

// Decision is the route of one request; Cell is valid only when HasCell.
type Decision struct {
	Route    Route
	Reason   Reason
	Explored bool
	HasCell  bool
	Cell     [3]int // context bin, io-ratio bin, qps bin
}

func valid(f *Features) bool {
	for _, v := range [...]float64{f.ContextTokens, f.AppendTokens, f.ExpectedOutputTokens, f.QPS} {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return false
		}
	}
	return f.Turn >= 1 && f.ExpectedOutputTokens > 0
}

// binIndex: inclusive upper edges; a value equal to an edge is in that bin, a value beyond
// the last edge in the last bin (Python's bisect_left, capped).
func binIndex(edges []float64, v float64) int {
	i := sort.SearchFloat64s(edges, v)
	if i >= len(edges) {
		return len(edges) - 1
	}
	return i
}

// prefillBusy: the override is on (need > 0) and the least-busy prefill worker has at
// least need requests waiting; false for NaN (comparisons with NaN are false) and +Inf.
func prefillBusy(need uint32, waiting float64) bool {
	return need > 0 && float64(need) <= waiting && !math.IsInf(waiting, 1)
}

// Decide routes one request with a policy from Parse (a Policy built by hand must satisfy
// the same rules: Parse's validation is what makes Decide's indexing safe). draw returns a uniform float in [0, 1); it is called only
// when the request's cell has a non-zero exploration fraction. Decide never panics on bad
// features: they get the policy's default route with ReasonInvalidInput.
func (p *Policy) Decide(f Features, draw func() float64) Decision {
	if !valid(&f) {
		return Decision{Route: p.Default, Reason: ReasonInvalidInput}
	}
	o := &p.Overrides
	if f.Turn == 1 {
		if o.FirstTurnRoute == PrefillNode && prefillBusy(o.FirstTurnBusyWaiting, f.PrefillWaiting) {
			return Decision{Route: DecodeLocal, Reason: ReasonBusyPrefill}
		}
		return Decision{Route: o.FirstTurnRoute, Reason: ReasonFirstTurn}
	}
	if f.AppendTokens < float64(o.BypassAppendTokens) {
		return Decision{Route: DecodeLocal, Reason: ReasonBypass}
	}
	c := binIndex(p.Axes.ContextTokens, f.ContextTokens)
	io := binIndex(p.Axes.IORatio, f.AppendTokens/f.ExpectedOutputTokens)
	q := binIndex(p.Axes.QPS, f.QPS)
	idx := (c*len(p.Axes.IORatio)+io)*len(p.Axes.QPS) + q
	route := p.Routes[idx]
	d := Decision{Route: route, Reason: ReasonTable, HasCell: true, Cell: [3]int{c, io, q}}
	if e := p.Exploration[idx]; e > 0 && draw() < e {
		d.Route, d.Reason, d.Explored = route.Other(), ReasonExplore, true
		return d
	}
	if route == PrefillNode && o.FirstTurnRoute == PrefillNode &&
		prefillBusy(o.LaterTurnBusyWaiting, f.PrefillWaiting) {
		d.Route, d.Reason = DecodeLocal, ReasonBusyLaterTurn
	}
	return d
}
