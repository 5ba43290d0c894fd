// Command pdcheck prints what this package computes for a policy file and a stream of
// features, so a test can compare it with the Python reference (controller/policy) on
// random policies: the first output line is {"checksum", "canonical_bytes_hex"} or
// {"error"}; then, for each input line {"features": {...}, "draw": u}, one line
// {"route", "reason", "cell", "explored"}. Features use the conformance file's form
// (numbers, or "NaN" / "Infinity" / "-Infinity"; prefill_waiting may be absent).
package main

import (
	"bufio"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"os"

	pdpolicy "github.com/pd-controller/pd-controller/adopters/go"
)

func number(raw map[string]json.RawMessage, key string, absent float64) float64 {
	v, ok := raw[key]
	if !ok {
		return absent
	}
	var s string
	if json.Unmarshal(v, &s) == nil {
		return map[string]float64{"NaN": math.NaN(), "Infinity": math.Inf(1),
			"-Infinity": math.Inf(-1)}[s]
	}
	var x float64
	_ = json.Unmarshal(v, &x)
	return x
}

func main() {
	out := json.NewEncoder(os.Stdout)
	data, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	p, err := pdpolicy.Parse(data)
	if err != nil {
		_ = out.Encode(map[string]string{"error": err.Error()})
		return
	}
	_ = out.Encode(map[string]string{"checksum": p.Checksum,
		"canonical_bytes_hex": hex.EncodeToString(pdpolicy.CanonicalBytes(p))})
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<20)
	for in.Scan() {
		var c struct {
			Features map[string]json.RawMessage `json:"features"`
			Draw     float64                    `json:"draw"`
		}
		if err := json.Unmarshal(in.Bytes(), &c); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		f := pdpolicy.Features{Turn: int64(number(c.Features, "turn", 0)),
			ContextTokens:        number(c.Features, "context_tokens", 0),
			AppendTokens:         number(c.Features, "append_tokens", 0),
			ExpectedOutputTokens: number(c.Features, "expected_output_tokens", 0),
			QPS:                  number(c.Features, "qps", 0),
			PrefillWaiting:       number(c.Features, "prefill_waiting", math.NaN())}
		d := p.Decide(f, func() float64 { return c.Draw })
		var cell any
		if d.HasCell {
			cell = d.Cell
		}
		_ = out.Encode(map[string]any{"route": d.Route.String(), "reason": d.Reason.String(),
			"cell": cell, "explored": d.Explored})
	}
}
