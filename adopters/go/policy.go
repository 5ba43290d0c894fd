// Package pdpolicy runs pd-controller's routing policy inside a Go router: it reads the
// policy JSON file (schema_version 1, docs/policy-format.md), verifies its checksum exactly
// as controller/policy/checksum.py computes it, and decides every request in-process with
// the rule of controller/policy/decide.py. It uses only the standard library.
//
// A Policy is immutable once parsed; Watcher swaps whole policies atomically, so Decide is
// safe from any number of goroutines while a new file lands.
package pdpolicy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"time"
)

// Route is where a turn's append-prefill runs. Values are the wire values (protobuf enum
// numbers, also the bytes of the canonical encoding).
type Route uint8

const (
	PrefillNode Route = 1 // classic P/D: a prefill worker computes, then KV moves to decode
	DecodeLocal Route = 2 // the session's decode worker computes the new tokens itself
)

// String returns the canonical name used in the JSON file and in pdrouter_* labels.
func (r Route) String() string {
	switch r {
	case PrefillNode:
		return "PREFILL_NODE"
	case DecodeLocal:
		return "DECODE_LOCAL"
	}
	return fmt.Sprintf("Route(%d)", uint8(r))
}

// Other is the other route (the one exploration tries).
func (r Route) Other() Route {
	if r == PrefillNode {
		return DecodeLocal
	}
	return PrefillNode
}

// ParseRoute accepts the canonical names and the seed config's words, like Route.parse in
// controller/policy/model.py (case-insensitive, surrounding spaces ignored).
func ParseRoute(s string) (Route, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "PREFILL_NODE", "PREFILL":
		return PrefillNode, nil
	case "DECODE_LOCAL", "DECODE", "LOCAL":
		return DecodeLocal, nil
	}
	return 0, fmt.Errorf("unknown route %q: expected PREFILL_NODE (or prefill) or "+
		"DECODE_LOCAL (or decode, local)", s)
}

// Limits of the format (controller/policy/validation.py and model.py).
const (
	SchemaVersion   = 1
	MaxEdgesPerAxis = 64
	MaxExploration  = 0.2
	MaxVersion      = math.MaxInt64
	MaxBypassTokens = math.MaxUint32
	MaxBusyWaiting  = math.MaxUint32
	MaxFileBytes    = 32 * 1024 * 1024
)

// Axes holds strictly increasing inclusive upper bin edges per axis.
type Axes struct {
	ContextTokens []float64
	IORatio       []float64
	QPS           []float64
}

// Overrides are the rules applied before the table (docs/policy-format.md, steps 2, 3, 6).
type Overrides struct {
	FirstTurnRoute       Route
	BypassAppendTokens   uint64
	FirstTurnBusyWaiting uint32
	LaterTurnBusyWaiting uint32
}

// Policy is one parsed, validated policy. Do not modify it after Parse: decisions read it
// from many goroutines.
type Policy struct {
	Version     int64
	Axes        Axes
	Routes      []Route
	Scores      []float64
	Exploration []float64
	WTFT, WTPOT float64
	SLOTTFT     float64 // seconds
	SLOTPOT     float64 // seconds
	Overrides   Overrides
	Default     Route
	// Checksum is the hex sha256 of CanonicalBytes, computed on parse.
	Checksum string
}

// Problem is one reason a file is refused, with its field path (axes.io_ratio[3], ...).
type Problem struct {
	Path    string
	Message string
}

func (p Problem) String() string { return p.Path + ": " + p.Message }

// ValidationError lists every problem of a refused file at once.
type ValidationError struct{ Problems []Problem }

func (e *ValidationError) Error() string {
	lines := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		lines[i] = "  - " + p.String()
	}
	return fmt.Sprintf("invalid policy (%d problem(s)):\n%s", len(e.Problems),
		strings.Join(lines, "\n"))
}

// rawPolicy mirrors the JSON file; pointers tell "absent" from a zero value.
type rawPolicy struct {
	SchemaVersion *int64         `json:"schema_version"`
	Version       *int64         `json:"version"`
	Checksum      *string        `json:"checksum"`
	Axes          *rawAxes       `json:"axes"`
	Routes        []string       `json:"routes"`
	Scores        []float64      `json:"scores"`
	Exploration   []float64      `json:"exploration"`
	Weights       *rawWeights    `json:"weights"`
	SLO           *rawSLO        `json:"slo"`
	Overrides     *rawOverrides  `json:"overrides"`
	DefaultRoute  *string        `json:"default_route"`
	Provenance    *rawProvenance `json:"provenance"`
}

type rawAxes struct {
	ContextTokens []float64 `json:"context_tokens"`
	IORatio       []float64 `json:"io_ratio"`
	QPS           []float64 `json:"qps"`
}

type rawWeights struct {
	WTFT  *float64 `json:"wtft"`
	WTPOT *float64 `json:"wtpot"`
}

type rawSLO struct {
	TTFT *float64 `json:"ttft_s"`
	TPOT *float64 `json:"tpot_s"`
}

type rawOverrides struct {
	FirstTurnRoute       *string `json:"first_turn_route"`
	BypassAppendTokens   *int64  `json:"bypass_append_tokens"`
	FirstTurnBusyWaiting *int64  `json:"first_turn_busy_waiting"`
	LaterTurnBusyWaiting *int64  `json:"later_turn_busy_waiting"`
}

type rawProvenance struct {
	CreatedAt   *string `json:"created_at"`
	Reason      *string `json:"reason"`
	CreatedBy   *string `json:"created_by"`
	TrainedFrom *string `json:"trained_from"`
	TrainedTo   *string `json:"trained_to"`
}

// Parse reads and validates a policy file's bytes. It refuses unknown keys, duplicate keys,
// NaN/Infinity literals, wrong types, every rule of docs/policy-format.md, and a checksum
// that does not match the content; the error is a *ValidationError naming every problem
// found by validation (a JSON syntax or type error stops parsing and is reported alone).
func Parse(data []byte) (*Policy, error) {
	if len(data) > MaxFileBytes {
		return nil, &ValidationError{[]Problem{{"$", fmt.Sprintf("file larger than %d bytes",
			MaxFileBytes)}}}
	}
	if err := checkTokens(data); err != nil {
		return nil, &ValidationError{[]Problem{{"$", "not valid JSON: " + err.Error()}}}
	}
	var raw rawPolicy
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return nil, &ValidationError{[]Problem{{"$", "not valid JSON: " + err.Error()}}}
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, &ValidationError{[]Problem{{"$", "not valid JSON: extra data after the object"}}}
	}
	return fromRaw(&raw)
}

func fromRaw(raw *rawPolicy) (*Policy, error) {
	var probs []Problem
	bad := func(path, msg string) { probs = append(probs, Problem{path, msg}) }
	if raw.SchemaVersion == nil || *raw.SchemaVersion != SchemaVersion {
		bad("schema_version", "unsupported schema_version (this build reads 1)")
	}
	p := &Policy{WTFT: 1, WTPOT: 1, Default: PrefillNode,
		Overrides: Overrides{FirstTurnRoute: PrefillNode}}
	if raw.Version == nil {
		bad("version", "missing")
	} else if *raw.Version < 1 {
		bad("version", fmt.Sprintf("must be between 1 and %d, got %d", int64(MaxVersion),
			*raw.Version))
	} else {
		p.Version = *raw.Version
	}
	if raw.Axes == nil {
		for _, n := range []string{"context_tokens", "io_ratio", "qps"} {
			bad("axes."+n, "missing")
		}
	} else {
		p.Axes = Axes{raw.Axes.ContextTokens, raw.Axes.IORatio, raw.Axes.QPS}
		for _, ax := range []struct {
			name  string
			edges []float64
		}{{"context_tokens", p.Axes.ContextTokens}, {"io_ratio", p.Axes.IORatio},
			{"qps", p.Axes.QPS}} {
			probs = append(probs, validateEdges("axes."+ax.name, ax.edges)...)
		}
	}
	probs = append(probs, p.readCells(raw)...)
	probs = append(probs, p.readScalars(raw)...)
	if len(probs) == 0 {
		p.Checksum = Checksum(p)
		if raw.Checksum != nil && *raw.Checksum != p.Checksum {
			bad("checksum", fmt.Sprintf("does not match the content (file %q, computed %q): "+
				"the file was edited or corrupted", *raw.Checksum, p.Checksum))
		}
	}
	if len(probs) > 0 {
		return nil, &ValidationError{probs}
	}
	return p, nil
}

func (p *Policy) readCells(raw *rawPolicy) []Problem {
	var probs []Problem
	bad := func(path, msg string) { probs = append(probs, Problem{path, msg}) }
	nIO, nQPS := len(p.Axes.IORatio), len(p.Axes.QPS)
	n := len(p.Axes.ContextTokens) * nIO * nQPS
	if raw.Routes == nil {
		bad("routes", "must be a list of route names")
	}
	p.Routes = make([]Route, len(raw.Routes))
	for i, s := range raw.Routes {
		r, err := ParseRoute(s)
		if err != nil {
			bad(fmt.Sprintf("routes[%d]", i), err.Error())
		}
		p.Routes[i] = r
	}
	p.Scores = raw.Scores
	p.Exploration = raw.Exploration
	if raw.Exploration == nil {
		p.Exploration = make([]float64, len(raw.Routes))
	}
	shape := fmt.Sprintf("(%d, %d, %d)", len(p.Axes.ContextTokens), nIO, nQPS)
	for _, f := range []struct {
		name string
		got  int
	}{{"routes", len(p.Routes)}, {"scores", len(p.Scores)}, {"exploration", len(p.Exploration)}} {
		if f.got != n {
			bad(f.name, fmt.Sprintf("needs %d cells (axes shape %s), got %d", n, shape, f.got))
		}
	}
	for i, s := range p.Scores {
		if !finite(s) {
			bad(fmt.Sprintf("scores[%d]", i), fmt.Sprintf("must be a finite number, got %v", s))
		}
	}
	for i, e := range p.Exploration {
		if !finite(e) || e < 0 || e > MaxExploration {
			bad(fmt.Sprintf("exploration[%d]", i),
				fmt.Sprintf("must be within [0, %v], got %v", MaxExploration, e))
		}
	}
	return probs
}

func (p *Policy) readScalars(raw *rawPolicy) []Problem {
	var probs []Problem
	bad := func(path, msg string) { probs = append(probs, Problem{path, msg}) }
	if w := raw.Weights; w != nil {
		if w.WTFT != nil {
			p.WTFT = *w.WTFT
		}
		if w.WTPOT != nil {
			p.WTPOT = *w.WTPOT
		}
	}
	for _, w := range []struct {
		name string
		v    float64
	}{{"wtft", p.WTFT}, {"wtpot", p.WTPOT}} {
		if !finite(w.v) || w.v < 0 {
			bad("weights."+w.name, fmt.Sprintf("must be a finite number >= 0, got %v", w.v))
		}
	}
	if p.WTFT == 0 && p.WTPOT == 0 {
		bad("weights", "wtft and wtpot cannot both be 0")
	}
	slo := raw.SLO
	if slo == nil {
		slo = &rawSLO{}
	}
	for _, s := range []struct {
		name string
		v    *float64
		dst  *float64
	}{{"ttft_s", slo.TTFT, &p.SLOTTFT}, {"tpot_s", slo.TPOT, &p.SLOTPOT}} {
		switch {
		case s.v == nil:
			bad("slo."+s.name, "missing")
		case !finite(*s.v) || *s.v <= 0:
			bad("slo."+s.name, fmt.Sprintf("must be a finite number > 0, got %v", *s.v))
		default:
			*s.dst = *s.v
		}
	}
	probs = append(probs, p.readOverrides(raw.Overrides)...)
	if raw.DefaultRoute != nil {
		r, err := ParseRoute(*raw.DefaultRoute)
		if err != nil {
			bad("default_route", err.Error())
		}
		p.Default = r
	}
	return append(probs, validateProvenance(raw.Provenance)...)
}

func (p *Policy) readOverrides(o *rawOverrides) []Problem {
	var probs []Problem
	if o == nil {
		return nil
	}
	if o.FirstTurnRoute != nil {
		r, err := ParseRoute(*o.FirstTurnRoute)
		if err != nil {
			probs = append(probs, Problem{"overrides.first_turn_route", err.Error()})
		}
		p.Overrides.FirstTurnRoute = r
	}
	for _, f := range []struct {
		name string
		v    *int64
		top  int64
		set  func(int64)
	}{
		{"bypass_append_tokens", o.BypassAppendTokens, MaxBypassTokens,
			func(v int64) { p.Overrides.BypassAppendTokens = uint64(v) }},
		{"first_turn_busy_waiting", o.FirstTurnBusyWaiting, MaxBusyWaiting,
			func(v int64) { p.Overrides.FirstTurnBusyWaiting = uint32(v) }},
		{"later_turn_busy_waiting", o.LaterTurnBusyWaiting, MaxBusyWaiting,
			func(v int64) { p.Overrides.LaterTurnBusyWaiting = uint32(v) }},
	} {
		if f.v == nil {
			continue
		}
		if *f.v < 0 || *f.v > f.top {
			probs = append(probs, Problem{"overrides." + f.name,
				fmt.Sprintf("must be an integer in [0, %d], got %d", f.top, *f.v)})
			continue
		}
		f.set(*f.v)
	}
	return probs
}

func validateEdges(path string, edges []float64) []Problem {
	var probs []Problem
	if len(edges) < 1 || len(edges) > MaxEdgesPerAxis {
		probs = append(probs, Problem{path, fmt.Sprintf("needs 1 to %d edges, got %d",
			MaxEdgesPerAxis, len(edges))})
	}
	for i, e := range edges {
		at := fmt.Sprintf("%s[%d]", path, i)
		if e < 0 {
			probs = append(probs, Problem{at, fmt.Sprintf("edge must be >= 0, got %v", e)})
		}
		if i > 0 && e <= edges[i-1] {
			probs = append(probs, Problem{at, fmt.Sprintf(
				"edges must be strictly increasing (%v <= %v)", e, edges[i-1])})
		}
	}
	return probs
}

// validateProvenance checks the timestamps: ISO-8601 with a time zone, or null. Accepted
// forms: RFC 3339 with a "T" or a space between date and time, as Python's isoformat writes.
func validateProvenance(pv *rawProvenance) []Problem {
	if pv == nil {
		return nil
	}
	var probs []Problem
	for _, f := range []struct {
		name string
		v    *string
	}{{"created_at", pv.CreatedAt}, {"trained_from", pv.TrainedFrom}, {"trained_to", pv.TrainedTo}} {
		if f.v == nil {
			continue
		}
		s := strings.Replace(*f.v, " ", "T", 1)
		if _, err := time.Parse(time.RFC3339Nano, s); err != nil {
			probs = append(probs, Problem{"provenance." + f.name,
				fmt.Sprintf("not an ISO-8601 timestamp with a time zone: %q", *f.v)})
		}
	}
	return probs
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// nullable are the only keys whose value may be null (provenance timestamps), as in the
// Python reader; encoding/json would otherwise read a null number as 0 and a null object or
// string as absent.
var nullable = map[string]bool{"created_at": true, "trained_from": true, "trained_to": true}

// checkTokens walks the JSON tokens and refuses an object with a key twice (encoding/json
// would silently keep the last one, so "version": 2, "version": 99 would apply v99 while an
// unknown key is refused) and a null anywhere but a provenance timestamp.
func checkTokens(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	type frame struct {
		keys      map[string]struct{} // nil: an array
		expectKey bool
		key       string // the key whose value comes next
	}
	var stack []*frame
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if s, isKey := tok.(string); isKey && top != nil && top.keys != nil && top.expectKey {
			if _, dup := top.keys[s]; dup {
				return fmt.Errorf("duplicate key %q", s)
			}
			top.keys[s], top.expectKey, top.key = struct{}{}, false, s
			continue
		}
		if tok == nil && (top == nil || top.keys == nil || !nullable[top.key]) {
			where := "in a list"
			if top != nil && top.keys != nil {
				where = fmt.Sprintf("for key %q", top.key)
			}
			return errors.New("null is not allowed " + where)
		}
		if top != nil && top.keys != nil {
			top.expectKey = true // this token is (or opens) the pair's value
		}
		if d, ok := tok.(json.Delim); ok {
			switch d {
			case '{':
				stack = append(stack, &frame{keys: map[string]struct{}{}, expectKey: true})
			case '[':
				stack = append(stack, &frame{})
			case '}', ']':
				stack = stack[:len(stack)-1]
				if len(stack) > 0 && stack[len(stack)-1].keys != nil {
					stack[len(stack)-1].expectKey = true
				}
			}
		}
	}
}
