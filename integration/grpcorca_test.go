package integration

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	v3orcapb "github.com/cncf/xds/go/xds/data/orca/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/orca"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// orcaMetadataKey is the metadata key grpc-go's ORCA recorder sends
// per-call reports under, in the call's trailers.
const orcaMetadataKey = "endpoint-load-metrics-bin"

// orcaService is grpc's interop test service, whose unary call records
// an ORCA per-call report through grpc-go's own recorder: cpu 0.42,
// application utilization 0.6 and a named metric, or, for a call that
// asks for an error status, cpu 0.9 and the error (a call that ends
// without a message: gRPC sends its trailers as the only headers).
type orcaService struct {
	testpb.UnimplementedTestServiceServer
}

func (orcaService) UnaryCall(ctx context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	rec := orca.CallMetricsRecorderFromContext(ctx)
	if rec == nil {
		return nil, status.Error(codes.Internal, "no ORCA call metrics recorder: the server option is missing")
	}
	if st := req.GetResponseStatus(); st != nil {
		rec.SetCPUUtilization(0.9)
		return nil, status.Error(codes.Code(st.GetCode()), st.GetMessage())
	}
	rec.SetCPUUtilization(0.42)
	rec.SetApplicationUtilization(0.6)
	rec.SetNamedMetric("queue", 3)
	return &testpb.SimpleResponse{Payload: &testpb.Payload{Body: make([]byte, req.GetResponseSize())}}, nil
}

// orcaBackend serves orcaService on 127.0.0.1 in cleartext HTTP/2, with
// grpc-go's per-call ORCA reporting on, and returns its address.
func orcaBackend(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(orca.CallMetricsServerOption(nil))
	testpb.RegisterTestServiceServer(srv, orcaService{})
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return ln.Addr().String()
}

// A real third-party emitter of ORCA reports (issue 27): a grpc-go
// server whose handler records per-call metrics with grpc-go's orca
// package, which sends them as binary metadata in the call's trailers,
// behind Caddy (reverse_proxy over h2c, least_time with no options),
// called by a grpc-go client over h2c. lbx reads the report from the
// trailers, shows it in /lbx/upstreams, and keeps it from the client;
// with forward_header the client gets it intact. A call that fails
// carries its report in the response's headers (gRPC's trailers-only
// form), which is read too.
func TestGRPCOrcaReportsThroughCaddy(t *testing.T) {
	e := newEnv(t)
	backend := orcaBackend(t)
	site := func(policy string) string {
		return fmt.Sprintf("reverse_proxy h2c://%s {\n\tlb_policy least_time%s\n}", backend, policy)
	}
	e.load(site(""))

	cc, err := grpc.NewClient(fmt.Sprintf("passthrough:///127.0.0.1:%d", httpPort),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	client := testpb.NewTestServiceClient(cc)
	call := func(req *testpb.SimpleRequest) (header, trailer metadata.MD, err error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err = client.UnaryCall(ctx, req, grpc.Header(&header), grpc.Trailer(&trailer))
		return header, trailer, err
	}

	header, trailer, err := call(&testpb.SimpleRequest{ResponseSize: 100})
	if err != nil {
		t.Fatalf("call through Caddy: %v", err)
	}
	if v := append(header.Get(orcaMetadataKey), trailer.Get(orcaMetadataKey)...); len(v) != 0 {
		t.Fatalf("the client got the report: headers %q, trailers %q", header, trailer)
	}
	u := fetchReported(t, backend)
	if r := u.Report; r == nil || r.CPU == nil || *r.CPU != 0.42 || r.Utilization == nil || *r.Utilization != 0.6 ||
		r.Named["queue"] != 3 || r.Stale || u.Refused != 0 {
		t.Fatalf("load report in the admin API: %+v (report %+v)", u, u.Report)
	}

	// a failed call: the report comes in the response's headers
	_, trailer, err = call(&testpb.SimpleRequest{ResponseStatus: &testpb.EchoStatus{Code: int32(codes.ResourceExhausted), Message: "busy"}})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("failing call: %v, want ResourceExhausted", err)
	}
	if v := trailer.Get(orcaMetadataKey); len(v) != 0 {
		t.Fatalf("the client got the failed call's report: %q", trailer)
	}
	if u := fetchReported(t, backend); u.Report == nil || u.Report.CPU == nil || *u.Report.CPU != 0.9 || u.Refused != 0 {
		t.Fatalf("load report after the failed call: %+v (report %+v)", u, u.Report)
	}

	// forward_header passes the report on, as the client's own ORCA
	// reader would read it
	e.load(site(" {\n\t\tload_reports {\n\t\t\tforward_header\n\t\t}\n\t}"))
	_, trailer, err = call(&testpb.SimpleRequest{ResponseSize: 100})
	if err != nil {
		t.Fatalf("call with forward_header: %v", err)
	}
	v := trailer.Get(orcaMetadataKey)
	if len(v) != 1 {
		t.Fatalf("forward_header: the client's trailers %v lack %s", trailer, orcaMetadataKey)
	}
	var r v3orcapb.OrcaLoadReport
	if err := proto.Unmarshal([]byte(v[0]), &r); err != nil {
		t.Fatalf("forwarded report: %v", err)
	}
	if r.GetCpuUtilization() != 0.42 || r.GetApplicationUtilization() != 0.6 || r.GetNamedMetrics()["queue"] != 3 {
		t.Fatalf("forwarded report: %v", strings.TrimSpace(r.String()))
	}
	if u := fetchReported(t, backend); u.Report == nil || *u.Report.CPU != 0.42 || u.Report.Stale {
		t.Fatalf("load report with forward_header: %+v", u.Report)
	}
}
